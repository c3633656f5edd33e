"""Replies: a request's choices merged into one SSE stream or one JSON object."""

"""Constrained outputs: what a request asks its output to follow, as one grammar."""

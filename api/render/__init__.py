"""Replies on the wire, in one place: every wire format (chat, completions, the Responses API)
is one renderer (`renderer.Renderer`: `chat`, `completions`, `responses`) over the same
per-choice events (`walk`), run by one streaming driver (`stream`: SSE, numbered for resuming)
or one collecting driver (`collect`: one JSON object). `spec` is what rendering a chat or
completions reply needs, shared with its resumed stream (`api.queue.replay`); `formats` picks its
renderer; `http` sends any JSON body."""

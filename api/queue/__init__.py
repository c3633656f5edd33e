"""The queue side: a request's way through Redis and back, whatever its wire format.

`context` (the replica's `AppContext`), `generation` (one choice: admitted, then read until
its terminal entry), `replay` (a resumed stream read from its record), `reader` and
`subscription` (the replica's one feed read), `admission`, `placement`, `limits` and
`worker_watch` (what a request needs before it is queued), `metrics` and `trace`. It imports
only `api.protocol` below it; rendering (`api.render`) and the endpoints sit above.
"""

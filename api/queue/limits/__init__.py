"""Per-tenant rate limits, the replica's side: what a reply is charged and what the admission
script said of its buckets (`bucket`), a reply's reservation settled at its end
(`reservation`), and what a client sees of them (`replies`). The buckets' Lua is
shared/scripts/limits.py."""

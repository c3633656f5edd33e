"""Who may call a replica, and how much one call may send: API keys and their tenants
(`keys`), checked with the body's bounds at the door of every /v1/ route and of /tokenize and
/detokenize (`guard`)."""

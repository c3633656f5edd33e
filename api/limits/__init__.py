"""Per-tenant rate limits: the buckets inside the admission script (`bucket`), a reply's
reservation settled at its end (`reservation`), and what a client sees of them (`replies`)."""

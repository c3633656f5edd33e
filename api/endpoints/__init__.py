"""The HTTP endpoints, one module or package per OpenAI endpoint family: `chat`
(/v1/chat/completions), `completions` (/v1/completions), `responses` (/v1/responses),
`tokenize` (/tokenize, /detokenize), `requests` (cancel or resume a request by id) and
`status` (/v1/models, /health, /ready, /metrics, /queue). No endpoint module imports another:
what they share is `serving` (from a tokenized body to its reply) and `common` (the context,
the served model, the tenant, a request's stored state).
"""

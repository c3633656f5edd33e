"""The bottom layer: what a request and its reply are, before anything is queued or rendered.

The request bodies (`bodies`, `responses_body`, built of `fields`), the errors every layer
raises (`errors`) and the one JSON response (`http`), the served model and its tokenizer
(`served_model`, `text`), what rendering a reply needs (`reply_spec`), and the tool-call and
structured-output syntax and grammars (`tools`, `structured_output`). It imports no other part
of `api`, so every layer above can use it.
"""

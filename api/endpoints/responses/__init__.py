"""OpenAI's Responses API (`/v1/responses`): its body, its conversation as items, its stored
responses in Redis, background responses and resumed streams. Its renderer is one of
`api.render`'s."""

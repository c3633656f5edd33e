"""OpenAI's Responses API (`/v1/responses`): its body, its conversation as items, its renderer
over a choice's token events, and its stored responses in Redis."""

"""The API replica: OpenAI-compatible HTTP in front of the Redis request and result streams."""

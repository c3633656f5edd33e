"""The worker: reads requests from Redis, runs the model in batches, publishes tokens."""

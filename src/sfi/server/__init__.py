"""The OpenAI-compatible server: continuous batching engine and FastAPI app."""

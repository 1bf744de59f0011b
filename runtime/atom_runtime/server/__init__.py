"""`atom serve`: the OpenAI-compatible API server (FastAPI) in front of the EngineCore process."""

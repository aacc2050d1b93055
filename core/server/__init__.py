"""The OpenAI-compatible server: deepseek-recipe chat format, async engine front end, FastAPI app (docs/server.md)."""

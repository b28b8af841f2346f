"""The OpenAI-compatible API: request/response schemas and the serving logic."""

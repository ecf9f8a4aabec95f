"""The OpenAI-compatible server, its worker, and a client for any OpenAI-style server."""

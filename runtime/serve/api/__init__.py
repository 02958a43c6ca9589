"""The OpenAI-compatible HTTP API over a serving engine: request bodies (``protocol``), routes
and streaming (``app``), and starting/stopping uvicorn (``server``)."""

"""The OpenAI-compatible HTTP server (``api_server.build_app``), its two
completion handlers (``serving_chat``, ``serving_completion``), their shared
collect and SSE paths (``streaming``) and the middleware (``middleware``)."""

"""Ways in: the OpenAI-compatible server (``server``), its schemas
(``protocol``), the WebSocket API (``websocket``) and the ``aioengine`` CLI
(``cli``)."""

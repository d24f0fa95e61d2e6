"""Stock vLLM OpenAI servers as the router's backends: their settings (``spec``), their KV
events as the locality index and their ``/health`` and ``/metrics`` as membership and load
(``follower``), and requests forwarded to them over HTTP (``http_stream``)."""

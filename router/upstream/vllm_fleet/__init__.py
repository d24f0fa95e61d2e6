"""Stock vLLM OpenAI servers as the router's backends: their settings (``spec``), their KV
events as the locality index and their ``/health`` and ``/metrics`` as membership and load
(``follower``), and requests sent to them over the router's HTTP client (``http_pool``):
an HTTP client's request relayed as it is (``relay``), or read as messages for the gRPC
door (``http_stream``)."""

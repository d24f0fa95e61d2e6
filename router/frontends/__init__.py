"""The router's front doors: gRPC (``grpc_service``) and OpenAI HTTP (``http_api``).

Parsing, validation and error shapes live here; both doors hand a request to
``unicache.router.request_path.core``, which is what a request goes through.
"""

"""Generated protobuf and gRPC stubs (see proto/generate.py)."""

"""UniCache Serving: shared definitions (block hash, request class, trace reader, classifier)."""

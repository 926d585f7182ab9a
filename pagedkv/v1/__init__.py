"""Generated gRPC/protobuf stubs of the pagedkv v1 protocol (see proto/README.md)."""

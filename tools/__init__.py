"""Developer tooling (not shipped at run time): protobuf code generation."""

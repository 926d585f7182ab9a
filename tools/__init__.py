"""Developer tooling (not shipped at run time): protobuf code generation, the test suite's CPU report."""

"""The `block-manager` command line: `serve`, `admin …` (admin plane client), `replay`, `gen-trace`."""

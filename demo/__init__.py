"""What runs around the engine, not the engine: `pagedkv-demo` and its modes, the synthetic
serving driver (a scheduler over both services for the attention demo), its report, and the
local process stack that runs docker-compose.yml's services as processes."""

"""Offline trace tooling: the JSONL trace format, a seeded workload generator and an in-process
replay over the core (what `block-manager replay` / `gen-trace` run)."""

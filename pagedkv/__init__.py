"""pagedkv's ground floor: the generated protocol (`pagedkv.v1`), settings, logging, health check,
the gRPC server lifecycle, the client retry discipline and the one percentile definition.

It imports nothing of the floors above it (docs/architecture.md); public entry points of the
upper floors are re-exported lazily here, imported only when first used.
"""

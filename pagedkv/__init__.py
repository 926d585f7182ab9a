"""pagedkv: shared pieces of the block manager and compute node (logging, generated protocol)."""

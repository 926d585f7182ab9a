"""The compute node as a gRPC process: lifecycle (`server`), Forward servicer, the node object
(pool + table cache + registration), its link to the block manager, config, metrics, CLI."""

"""The block manager as a gRPC process: lifecycle (`server`), protocol ↔ domain translation
(`servicer`, `admin_servicer`), the replayable state machine around the core (`state`,
`state_codec`), durability and idempotency (`runtime`, `journal_writer`, `request_index`),
timers (`defrag_runner`), the error → status table (`interceptors`), config and metrics."""

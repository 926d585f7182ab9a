"""Child process for the crash tests: journals batches until killed.

Prints `ack <seq_no> <request_id>` only after `append` returned (i.e. the record is
acknowledged as durable), and `snap <seq_no>` after each snapshot. Not a test module.
"""

from __future__ import annotations

import sys

from store_helpers import make_record

from block_manager.store import StoreOptions, open_store


def main(url: str) -> None:
    store = open_store(url, StoreOptions(lock_wait_s=10.0))
    start = store.last_seq_no
    print(f"ready {start}", flush=True)
    batch_no = 0
    while True:
        batch_no += 1
        batch = [make_record(f"p{start}-b{batch_no}-{i}", num_seqs=8) for i in range(1 + batch_no % 3)]
        for seq_no, record in zip(store.append(batch), batch, strict=True):
            print(f"ack {seq_no} {record.request_id}", flush=True)
        if batch_no % 25 == 0:
            store.write_snapshot(store.last_seq_no, {"upto": store.last_seq_no})
            print(f"snap {store.last_seq_no}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

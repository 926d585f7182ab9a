"""`admin status` shows the disk tier under a pool's host tier (docs/tiers.md) as its own narrow
table that fits 80 columns with long ids and seven-digit counters; pools without one show none."""

from __future__ import annotations

import io

from rich.console import Console

from block_manager.cli.admin import _show_status
from tests.block_manager.client.test_admin_cli import _big_pool


def test_status_shows_the_disk_tier_in_80_columns() -> None:
    disk = dict(_big_pool("gpu-node-01"), host_num_blocks=4194304, disk_num_blocks=8388608,
                disk_cached_blocks=7654321, disk_offloaded_blocks=9876543, disk_onboarded_blocks=1234567,
                disk_hit_tokens=19753072)
    status = dict(state="serving", store="sqlite:///bm.db", num_nodes=2, num_sequences=1, last_seq_no=1,
                  uptime_s=1.0, pools=[disk, _big_pool("gpu-node-00")], _nodes=[])
    buf = io.StringIO()
    _show_status(Console(file=buf, width=80, highlight=False), status)
    out = buf.getvalue()
    assert max(len(line.rstrip()) for line in out.splitlines()) <= 80, out
    assert "…" not in out, out
    table = out[out.index("disk tier"):]
    for value in ("gpu-node-01", "8388608", "7654321", "9876543", "1234567", "19753072"):
        assert value in table, (value, out)
    assert "gpu-node-00" not in table

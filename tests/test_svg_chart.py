"""The demo's SVG chart: a valid document whose lines map data to the plot area."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from demo.svg_chart import Chart, Marker, Series, nice_ticks, write

NS = "{http://www.w3.org/2000/svg}"


@pytest.mark.parametrize(("lo", "hi"), [(0, 1), (0, 97), (3.5, 3.5), (-12, 250), (0, 12_345)])
def test_ticks_are_round_and_cover_the_range(lo: float, hi: float) -> None:
    ticks = nice_ticks(lo, hi)
    assert ticks[0] <= lo and ticks[-1] >= hi and 2 <= len(ticks) <= 8
    steps = {round(b - a, 9) for a, b in zip(ticks, ticks[1:], strict=False)}
    assert len(steps) == 1
    step = steps.pop()
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert round(mantissa, 6) in (1.0, 2.0, 5.0), ticks


def test_lines_map_data_into_the_plot_area(tmp_path: Path) -> None:
    chart = Chart("KV <memory> & time", "step", "blocks", series=[
        Series("paged", [0, 1, 2, 3], [0, 5, 2, 7]),
        Series("contiguous", [0, 1, 2, 3], [10, 10, 10, 10], dashed=True),
    ], markers=[Marker("capacity", 12), Marker("defrag", 2, vertical=True)])
    path = write(chart, tmp_path / "c.svg")
    root = ET.parse(path).getroot()           # well-formed, title escaped
    assert root.tag == f"{NS}svg"
    assert "KV <memory> & time" in [t.text for t in root.iter(f"{NS}text")]
    lines = root.findall(f"{NS}polyline")
    assert [line.find(f"{NS}title").text for line in lines] == ["paged", "contiguous"]
    frame = next(r for r in root.iter(f"{NS}rect") if r.get("stroke") == "black")
    x0, y0 = float(frame.get("x")), float(frame.get("y"))
    x1, y1 = x0 + float(frame.get("width")), y0 + float(frame.get("height"))
    paged = [tuple(map(float, p.split(","))) for p in lines[0].get("points").split()]
    flat = [tuple(map(float, p.split(","))) for p in lines[1].get("points").split()]
    assert all(x0 <= x <= x1 and y0 <= y <= y1 for x, y in paged + flat)
    xs = [x for x, _ in paged]
    assert xs == sorted(xs) and len(set(xs)) == 4                  # x grows to the right
    assert paged[3][1] < paged[1][1] < paged[2][1] < paged[0][1]   # 7 > 5 > 2 > 0: higher is up
    assert len({y for _, y in flat}) == 1 and flat[0][1] < paged[3][1]
    assert lines[1].get("stroke-dasharray") and not lines[0].get("stroke-dasharray")
    assert len([ln for ln in root.iter(f"{NS}line") if ln.get("class") == "marker"]) == 2
    assert not (tmp_path / "c.svg.tmp").exists()

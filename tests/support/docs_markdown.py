"""Reading markdown as GitHub renders it, for the docs-reference test
(tests/test_docs_references.py): lines in and out of fenced code, headings and their anchors,
links and code spans."""

from __future__ import annotations

import re
from dataclasses import dataclass

_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")

@dataclass(slots=True)
class Line:
    """One line of a doc: its number, its text, and whether it sits in a fenced code block (and
    which language the fence named)."""

    number: int
    text: str
    fence: str | None   # None: prose; "" or the language: inside a fenced block


def doc_lines(text: str) -> list[Line]:
    lines, fence, marker = [], None, ""
    for number, raw in enumerate(text.split("\n"), 1):
        m = _FENCE.match(raw)
        if m and fence is None:
            fence, marker = m.group(2).lower(), m.group(1)[0]
            continue
        if m and fence is not None and raw.strip().startswith(marker * 3):
            fence = None
            continue
        lines.append(Line(number, raw, fence))
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation other than `-`
    and `_` removed, each space a hyphen (so "Kernels — CUDA (H200)" is `kernels--cuda-h200`)."""
    text = LINK.sub(lambda m: m.group(1), heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in doc_lines(text):
        found.update(_HTML_ANCHOR.findall(line.text))
        if line.fence is not None:
            continue
        m = HEADING.match(line.text)
        if m:
            slug = github_slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found

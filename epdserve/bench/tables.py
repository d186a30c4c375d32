"""Tables of strings as aligned plain text and as GitHub markdown, so every bench report's
tables look alike."""

from __future__ import annotations


def _widths(header: list[str], rows: list[list[str]]) -> list[int]:
    return [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]


def _justify(row: list[str], widths: list[int], left: int) -> list[str]:
    return [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]


def text(header: list[str], rows: list[list[str]], left: int = 1) -> str:
    """Columns two spaces apart, the first ``left`` left-aligned, a dashed rule under the header."""
    widths = _widths(header, rows)
    lines = ["  ".join(_justify(r, widths, left)).rstrip() for r in [header, *rows]]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def markdown(header: list[str], rows: list[list[str]], left: int = 1, pad: bool = False) -> str:
    """``pad``: cells padded so the source lines up too (for a table also printed)."""
    widths = _widths(header, rows) if pad else [0] * len(header)
    line = lambda r: "| " + " | ".join(_justify(r, widths, left)) + " |"  # noqa: E731
    rule = "|" + "|".join("-" * max(w + 2, 3) if i < left else "-" * max(w + 1, 3) + ":"
                          for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), rule, *map(line, rows)])

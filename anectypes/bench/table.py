"""The one table renderer: every benchmark's table is a list of column specs and a list of rows."""

from typing import Any, Callable, NamedTuple


class Column(NamedTuple):
    heading: str
    width: int
    spec: str                       # the format spec after the width: "d", ".3f", ".1%", "s"
    value: Callable[[Any], Any]     # row -> the cell's value
    align: str = ">"                # "<" for the column that names the rows


def table(columns, rows):
    """A header line and a line per row; a heading is aligned like its cells."""
    lines = ["".join(format(c.heading, f"{c.align}{c.width}") for c in columns)]
    lines += ["".join(format(c.value(r), f"{c.align}{c.width}{c.spec}") for c in columns) for r in rows]
    return "\n".join(lines)

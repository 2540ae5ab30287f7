"""Tables for lessons: every column as wide as its content needs, padded cells, nothing cut off.

Plotly's ``go.Table`` has fixed column widths and cannot wrap a name without spaces, so long names
(``torch.amp.custom_fwd(device_type="cuda")``) get clipped. A :class:`Table` renders as HTML in a notebook
(cells padded, long text wrapped rather than cut, an optional title, note and row tints) and as plain text
elsewhere; its ``header`` and ``rows`` keep the full text, so a test can check that nothing was shortened::

    >>> from ampviz.lessons.tables import Table
    >>> t = Table(["old", "new"], [("torch.cuda.amp.autocast()", 'torch.amp.autocast("cuda")')], title="Spellings")
    >>> print(t)
    Spellings
    old                        new
    torch.cuda.amp.autocast()  torch.amp.autocast("cuda")

Used by lessons 03 (autocast) and 04b (autocast in your own code).
"""

from __future__ import annotations

import html

__all__ = ["Table", "TINTS"]

# Row tints, matched to the figures' colours (Okabe–Ito orange and bluish green, lightened)
TINTS = {"16-bit": "#FBE8CF", "cast": "#DDF1E8", "note": "#DCEEFB", "none": ""}
_CELL = "padding:3px 12px 3px 0;text-align:left;vertical-align:top;overflow-wrap:break-word"


class Table:
    """A table of ``rows`` (sequences of cells, shown with ``str``) under ``header``.

    Parameters
    ----------
    header : column names.
    rows : one sequence of cells per row, as long as ``header``.
    title, note : a bold line above the table and a small grey line under the title (optional).
    tints : one key of ``TINTS`` (or a CSS colour) per row, or None for no tint.
    code : indices of the columns shown in a monospaced font (names of ops and functions).
    """

    def __init__(self, header, rows, *, title: str | None = None, note: str | None = None, tints=None,
                 code=()):
        self.header = [str(h) for h in header]
        self.rows = [[str(c) for c in row] for row in rows]
        bad = [i for i, row in enumerate(self.rows) if len(row) != len(self.header)]
        if bad:
            raise ValueError(f"rows: row {bad[0]} has {len(self.rows[bad[0]])} cells, expected {len(self.header)} "
                             f"(one per header name)")
        self.tints = list(tints) if tints is not None else [None] * len(self.rows)
        if len(self.tints) != len(self.rows):
            raise ValueError(f"tints: expected one per row ({len(self.rows)}), got {len(self.tints)}")
        self.title, self.note, self.code = title, note, set(code)

    def _cell(self, j: int, text: str, tag: str = "td") -> str:
        body = html.escape(text)
        if tag == "td" and j in self.code:
            body = f"<code>{body}</code>"
        return f"<{tag} style='{_CELL}'>{body}</{tag}>"

    def _repr_html_(self) -> str:
        head = "".join(self._cell(j, h, "th") for j, h in enumerate(self.header))
        body = []
        for row, tint in zip(self.rows, self.tints):
            colour = TINTS.get(tint, tint) if tint else ""
            style = f" style='background:{colour}'" if colour else ""
            body.append(f"<tr{style}>" + "".join(self._cell(j, c) for j, c in enumerate(row)) + "</tr>")
        title = f"<div style='font-weight:600;margin:6px 0 2px'>{html.escape(self.title)}</div>" if self.title else ""
        note = f"<div style='color:#555;font-size:12px;margin-bottom:4px'>{html.escape(self.note)}</div>" \
            if self.note else ""
        return (f"{title}{note}<table style='border-collapse:collapse;font-size:12px;margin:0'>"
                f"<tr style='border-bottom:1px solid #999'>{head}</tr>{''.join(body)}</table>")

    def __repr__(self) -> str:
        widths = [max(len(r[j]) for r in [self.header, *self.rows]) for j in range(len(self.header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [self.header, *self.rows]]
        return "\n".join(([self.title] if self.title else []) + ([self.note] if self.note else []) + lines)

    def column(self, name: str) -> list[str]:
        """The cells of the column called ``name``."""
        if name not in self.header:
            raise ValueError(f"name: expected one of {self.header}, got {name!r}")
        j = self.header.index(name)
        return [r[j] for r in self.rows]

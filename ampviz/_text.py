"""Text from run files and command lines, made safe to show: every text output of ampviz goes through here.

Run files travel with bug reports, so a tensor name, a path or a title may carry a terminal escape
sequence (``\\x1b]0;...``), a right-to-left override (U+202E) that makes ``fc.weight`` read backwards,
or a lone surrogate (a file name that is not UTF-8, decoded by Python with ``surrogateescape``) that
no UTF-8 terminal or file can take. ``printable`` escapes all three::

    >>> from ampviz._text import printable
    >>> printable("fc\\x1b[2J")
    'fc\\\\x1b[2J'
    >>> printable("\\u202eflow")
    '\\\\u202eflow'
    >>> printable("run-\\udcff.npz")
    'run-\\\\udcff.npz'
"""

from __future__ import annotations

__all__ = ["printable", "lone_surrogate"]


def printable(text) -> str:
    """``text`` with control, format (bidi overrides, zero-width), separator and surrogate characters
    escaped as ``\\x..`` / ``\\u....``; every other character, the ASCII space included, kept."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for c in text)


def lone_surrogate(text: str) -> str | None:
    """The first lone surrogate of ``text`` (a character UTF-8 cannot encode), escaped, or None."""
    for c in text:
        if "\ud800" <= c <= "\udfff":
            return c.encode("unicode_escape", "backslashreplace").decode("ascii")
    return None

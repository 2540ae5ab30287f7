"""Exercises that make the learner predict first: the answer stays folded until they have written theirs.

An exercise cell holds the question and a blank for the prediction; the check below it compares the
prediction with the answer the notebook computes live, and only then explains. On Run All, an unanswered
check says so and keeps the answer in a folded "Show the answer" section (the learner may open it; nothing
is printed in the open)::

    from ampviz.lessons.exercises import check
    my_answer = ...                         # your prediction: the smallest integer fp16 cannot store
    check(my_answer, 2049, explain="ten mantissa bits: 2048 = 2^11 is exact, 2049 needs twelve")

Numbers compare with a relative tolerance (``rel``), strings without regard to case or surrounding
spaces, lists and tuples element-wise, sets as sets.

Used by lessons 01 to 13 (every lesson's Exercises section).
"""

from __future__ import annotations

import math
from collections.abc import Set

__all__ = ["check", "Check", "matches"]

_HOW = "Write your prediction in place of `...`, then run this cell again."


def matches(answer, expected, rel: float = 1e-6) -> bool:
    """Whether ``answer`` is ``expected``: numbers within ``rel`` (relative), strings ignoring case and
    surrounding spaces, sequences element by element, sets as sets, anything else by ``==``."""
    if isinstance(expected, bool) or isinstance(answer, bool):
        return isinstance(answer, bool) and isinstance(expected, bool) and answer is expected
    if isinstance(expected, (int, float)) and isinstance(answer, (int, float)):
        if math.isnan(expected) or math.isnan(answer):
            return math.isnan(expected) and math.isnan(answer)
        return answer == expected or math.isclose(answer, expected, rel_tol=rel, abs_tol=0.0)
    if isinstance(expected, str) and isinstance(answer, str):
        return answer.strip().casefold() == expected.strip().casefold()
    if isinstance(expected, Set) and isinstance(answer, (Set, list, tuple)):
        return len(set(answer)) == len(expected) and all(any(matches(a, e, rel) for e in expected)
                                                         for a in set(answer))
    if isinstance(expected, (list, tuple)) and isinstance(answer, (list, tuple)):
        return len(answer) == len(expected) and all(matches(a, e, rel) for a, e in zip(answer, expected))
    try:
        return bool(answer == expected)
    except Exception:                     # e.g. a tensor compared with a list: not the same answer
        return False


class Check:
    """The outcome of one check: ``answered``, ``right`` (None until answered), and its rendering.

    In a notebook it renders as HTML with the answer inside a closed ``<details>`` until the learner has
    answered; as text (a terminal, a headless run) it never prints the answer of an unanswered exercise."""

    def __init__(self, answer, expected, explain: str = "", rel: float = 1e-6):
        self.answer, self.expected, self.explain = answer, expected, explain
        self.answered = answer is not Ellipsis
        self.right = matches(answer, expected, rel) if self.answered else None

    def _verdict(self) -> str:
        if not self.answered:
            return _HOW
        if self.right:
            return f"Right: {self.expected!r}."
        return f"Not quite: you said {self.answer!r}; the notebook computes {self.expected!r}."

    def __repr__(self) -> str:
        if not self.answered:
            return _HOW
        return self._verdict() + (f" {self.explain}" if self.explain else "")

    def _repr_html_(self) -> str:
        from html import escape
        colour = "#666" if not self.answered else ("#007a3d" if self.right else "#b3261e")
        head = f'<p style="color:{colour};margin:0.2em 0">{escape(self._verdict())}</p>'
        body = escape(f"{self.expected!r}. {self.explain}".strip())
        if self.answered:
            return head + (f"<p style='margin:0.2em 0'>{escape(self.explain)}</p>" if self.explain else "")
        return head + f"<details><summary>Show the answer</summary><p>{body}</p></details>"


def check(answer, expected, *, explain: str = "", rel: float = 1e-6) -> Check:
    """Compare a learner's prediction with the answer the notebook computed.

    Parameters
    ----------
    answer : the learner's prediction; ``...`` (Ellipsis) means not answered yet.
    expected : the right answer, computed live by the lesson (never typed in).
    explain : one or two sentences on why, shown once the learner has answered.
    rel : relative tolerance for numbers.

    Returns
    -------
    Check, which displays the verdict (the answer folded away until answered).
    """
    if not isinstance(explain, str):
        raise TypeError(f"explain: expected a str, got {type(explain).__name__}")
    if not (isinstance(rel, (int, float)) and 0 <= rel < 1):
        raise ValueError(f"rel: expected a relative tolerance in [0, 1), got {rel!r}")
    return Check(answer, expected, explain, rel)

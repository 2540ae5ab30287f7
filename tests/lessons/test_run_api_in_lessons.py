"""Lessons read a recorded run through `Run`'s API (`counts_for`, `tensors_of`), not through masks built by hand.

A mask such as ``np.array(run.tensor_kinds) == "activation"`` indexes ``run.counts`` as stored: in the recorded
domain, with the rank and step axes the learner has to know, and silently wrong once a run mixes scaled and
unscaled kinds. Issue 19 asked that the lessons show the one read API the package documents.
"""

import json
import re
from pathlib import Path

import pytest

LESSONS = Path(__file__).resolve().parents[2] / "lessons"
NOTEBOOKS = sorted(LESSONS.glob("*.ipynb"))
# a kind mask or a hand-written kind loop: np.array(run.tensor_kinds), enumerate(run.tensor_kinds), zip(..., kinds)
HAND_MASK = re.compile(r"(np\.(?:as)?array\([^)]*tensor_kinds\)|enumerate\([^)]*tensor_kinds\)"
                       r"|\bkinds\s*==\s*[\"'])")


def hand_masks(path: Path) -> list:
    """(cell, line) pairs of ``path``'s code cells that select tensors by kind by hand."""
    out = []
    for i, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
        if cell["cell_type"] != "code":
            continue
        out += [(i, line.strip()) for line in "".join(cell["source"]).splitlines() if HAND_MASK.search(line)]
    return out


def test_the_pattern_finds_the_masks_issue_19_named():
    assert HAND_MASK.search('kinds = np.array(run.tensor_kinds)')
    assert HAND_MASK.search('acts = run.counts[:, :, kinds == "activation"]')
    assert HAND_MASK.search('rows = [t for t, k in enumerate(run32.tensor_kinds) if k == "weight"]')
    assert not HAND_MASK.search('acts = run.counts_for("recorded", kind="activation")')


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_lesson_selects_tensors_by_kind_by_hand(path):
    assert hand_masks(path) == []

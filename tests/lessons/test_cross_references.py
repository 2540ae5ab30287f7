"""Every "lesson NN §k" and every bare "§k" / "section k" in a lesson's text points at a section that exists.

Lessons were split (06 into 06 and 06b, 10 into 10 and 10b, ...) and will be renumbered; a reference that
survived a split ("lesson 06 §5" once 06 ends at §3) sends a learner to the wrong place.
"""

import json
import re
from pathlib import Path

import pytest

LESSONS = Path(__file__).resolve().parents[2] / "lessons"
NOTEBOOKS = sorted(LESSONS.glob("*.ipynb"))
# "lesson 06b §3", "lesson 06b section 3", "lesson 11's §2"
TO_LESSON = re.compile(r"[Ll]esson (\d\d[a-z]?)(?:'s)?,? (?:§\s?|section )(\d+)")
# "§3" or "section 3" with no lesson in front: a section of the same notebook
SAME_LESSON = re.compile(r"(?:§\s?|\bsection )(\d+)")


def _cells(path: Path) -> list:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _sections(path: Path) -> set:
    """Numbers of the notebook's "## k." headings."""
    return {int(m.group(1)) for c in _cells(path) if c["cell_type"] == "markdown"
            for m in re.finditer(r"^##\s+(\d+)\.", "".join(c["source"]), re.M)}


def _by_number() -> dict:
    return {p.stem.split("_")[0]: p for p in NOTEBOOKS if re.match(r"\d\d[a-z]?_", p.stem)}


def broken_references(path: Path, by_number: dict) -> list:
    """(cell, reference) pairs of ``path`` whose target lesson or section does not exist."""
    bad, own = [], _sections(path)
    for i, cell in enumerate(_cells(path)):
        text = "".join(cell["source"])
        for m in TO_LESSON.finditer(text):
            target = by_number.get(m.group(1))
            if target is None or int(m.group(2)) not in _sections(target):
                bad.append((i, m.group(0)))
        for m in SAME_LESSON.finditer(text):
            if re.search(r"[Ll]essons? \d\d[a-z]?(?:'s)?,? $", text[max(0, m.start() - 16):m.start()]):
                continue                                        # "lesson 10 §3": checked above
            if int(m.group(1)) not in own:
                bad.append((i, m.group(0)))
    return bad


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_section_references_point_at_existing_sections(path):
    bad = broken_references(path, _by_number())
    assert not bad, f"{path.name}: references to sections that do not exist: {bad}"


def test_a_reference_to_a_section_a_split_moved_is_caught(tmp_path):
    # lesson 06 ends at §3 since the split; "lesson 06 §5" (the forward overflow, now 06b §3) is stale
    note = tmp_path / "appendix_x.ipynb"
    note.write_text(json.dumps({"cells": [{"cell_type": "markdown", "source": [
        "no loss scale fixes a forward overflow (lesson 06 §5); see lesson 06b §3 and §1 below\n",
        "## 1. Here\n"]}]}), encoding="utf-8")
    assert broken_references(note, _by_number()) == [(0, "lesson 06 §5")]

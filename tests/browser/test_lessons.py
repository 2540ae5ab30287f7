"""Every lesson in a real JupyterLab in headless Chromium: it runs, every control responds, and nothing a
learner sees is visibly broken.

One test per notebook in ``lessons/`` (read from the folder: a new, split or renamed lesson is covered
with no change here). Each opens the notebook in the session's JupyterLab, runs all cells and waits for
every widget and graph; a cell that raises fails it, unless the cell is tagged ``raises-exception``. Then
it uses every ipywidgets control in the outputs (controls.py) and collects, to report all at once:

* each action on an enabled control after which nothing visible changed (graphs' data, titles, shapes and
  axis ranges; the text and the other controls of the control's cell);
* FigureWidgets drawn as blank axes (their data never reached the view) and explorers whose graph starts
  empty (no trace with a non-zero value);
* what lab_probe.js finds a learner would see broken, after Run All and after every action: text cut off
  by its box, table cells whose texts run together, plotly table cells cut at the column edge, scatter
  traces that leave a fixed axis range or whose markers are cut by the plot's edge;
* uncaught page errors and console errors.

Cells are numbered from 0 in notebook order (markdown included), as in the reviews. A lesson takes its
Run All time plus about a second per action (each waits for the kernel round trip; a control that changes
nothing costs GRACE_S more); run one with ``python -m pytest tests/browser/test_lessons.py -k 04 -s``.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from .controls import Exerciser
from .notebook_page import Clock, open_notebook, run_all

HERE = Path(__file__).resolve().parent
LESSONS = HERE.parents[1] / "lessons"
NOTEBOOKS = sorted(p.name for p in LESSONS.glob("*.ipynb"))
RUN_ALL_TIMEOUT_S = 600     # a lesson runs in about a minute on an idle 2-core CPU; this is a loaded one


def raising_cells(path: Path) -> list[int]:
    """Indices of the cells tagged ``raises-exception`` (JupyterLab runs on past them)."""
    cells = nbformat.read(path, as_version=4).cells
    return [i for i, c in enumerate(cells) if "raises-exception" in c.get("metadata", {}).get("tags", [])]


BARE = ("a FigureWidget drew blank axes: its data reached the page after the view drew (plotly sends a "
        "FigureWidget's data in an update after opening its comm, and anywidget can render first)")


# what JupyterLab's page raises for the requests a kernel had in flight when run_all replaced it after a stall (a CI
# dry run met it under load: "Canceled future for create_subshell_request message before replies were done")
REPLACED_KERNEL = re.compile(r"Canceled future for \w+ message before replies were done")


def findings(page, exerciser: Exerciser, initial_problems: list, empty: list, bare: list) -> list[tuple]:
    """Everything that fails the lesson: (cell or None, one line)."""
    problems = dict(exerciser.problems)
    for cell, problem in initial_problems:
        problems[(cell, problem)] = "after Run All"
    return ([(cell, f"cell {cell}: {BARE}") for cell in bare]
            + list(exerciser.failures)
            + [(cell, f"cell {cell}: explorer graph {title!r} starts empty (no trace with a non-zero value)")
               for cell, title in empty]
            + [(cell, f"cell {cell}: {problem} ({when})") for (cell, problem), when in sorted(problems.items())]
            + [(None, f"page error: {e}") for e in page.errors
               if not (getattr(page, "replaced_kernel", False) and REPLACED_KERNEL.search(e))]
            + [(None, f"console error: {e}") for e in page.console_errors])


def screenshots(page, cells, folder: Path) -> None:
    """One screenshot per cell with a finding (JupyterLab scrolls inside its panel: a page shot misses them)."""
    for cell in sorted(c for c in set(cells) if c is not None):
        page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").nth(cell).screenshot(
            path=str(folder / f"cell{cell:02d}.png"), timeout=30_000)


def check(page, lab, notebook: str, path: Path, tmp_path: Path):
    """Run ``notebook`` (at ``path`` here) in the page and use every control: (findings, exerciser)."""
    clock = Clock()
    lab.start_session(notebook)
    try:
        open_notebook(page, lab, notebook)
        clock("notebook open")
        run_all(page, lab, notebook, clock, raises=raising_cells(path), timeout_s=RUN_ALL_TIMEOUT_S)
        clock("all cells ran; widgets and graphs rendered")
        exerciser = Exerciser(page, lab, notebook)
        exerciser.settle()
        initial, bare = exerciser.probe("layoutProblems", None), exerciser.probe("bareFigureWidgets")
        explorers = sorted({c["cell"] for c in exerciser.scan()})
        empty = [(cell, title) for cell in explorers for title in exerciser.probe("emptyGraphs", cell)]
        exerciser.run()
        clock(f"{exerciser.controls} controls in {len(explorers)} cells, {exerciser.actions} actions")
        found = findings(page, exerciser, initial, empty, bare)
        for note in exerciser.notes:
            print(f"note: {note}")
        if found:
            screenshots(page, [cell for cell, _ in found], tmp_path)
        return [line for _, line in found], exerciser
    finally:
        lab.end_sessions(notebook)


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_lesson_runs_and_every_control_changes_what_a_learner_sees(lab, page, name, tmp_path):
    found, _ = check(page, lab, f"lessons/{name}", LESSONS / name, tmp_path)
    assert not found, f"{name}: {len(found)} problems a learner meets (screenshots of their cells in " \
        f"{tmp_path}):\n" + "\n".join(found)


# defects.ipynb shows one of each problem (and, for contrast, controls that work): the check reports exactly these
EXPECTED = ['cell 3 dropdown "dead": one -> two changed nothing visible',
            'cell 3 dropdown "dead": two -> one changed nothing visible',
            "cell 3: explorer graph 'all zero' starts empty",
            'cell 4 toggle-buttons "short | weight_local_and_more": short -> weight_local_and_more changed nothing',
            'cell 4 toggle-buttons "short | weight_local_and_more": weight_local_and_more -> short changed nothing',
            'cell 4: text does not fit its box: "weight_local_and_more"',
            'cell 4: table cells run together: "backward" and "ones_like"',
            'cell 5: figure "fixed ranges": "runs off" leaves the plot: 1 of 4 points outside the axis range',
            'cell 5: figure "fixed ranges": "on the edge": 1 of 1 markers cut by the plot\'s edge',
            'cell 6: figure "narrow column": plotly table cell cut off: "torch.cuda.amp.custom_fwd"']


@pytest.mark.browser
@pytest.mark.slow
def test_the_check_reports_each_kind_of_problem_and_passes_working_controls(lab, page, tmp_path):
    found, exerciser = check(page, lab, "defects.ipynb", HERE / "defects.ipynb", tmp_path)
    unexpected = [f for f in found if not any(f.startswith(e) for e in EXPECTED)]
    missing = [e for e in EXPECTED if not any(f.startswith(e) for f in found)]
    assert not unexpected and not missing, "reported but not expected:\n" + "\n".join(unexpected) \
        + "\nexpected but not reported:\n" + "\n".join(missing)
    used = {key[2] for key in exerciser.done}
    assert {"live", "enable the second slider", "second"} <= used, used     # "second": once the checkbox enabled it
    assert not page.errors and not page.console_errors


def test_defects_notebook_is_stripped():
    """No browser needed: the notebook the check is tested on is committed stripped."""
    nb = nbformat.read(HERE / "defects.ipynb", as_version=4)
    assert all(not c.outputs and c.execution_count is None for c in nb.cells if c.cell_type == "code")
    assert "widgets" not in nb.metadata and nb.metadata.kernelspec.name == "python3"

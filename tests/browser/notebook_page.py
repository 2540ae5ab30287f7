"""A notebook in JupyterLab driven from Playwright: open it, Run All, wait until it ran and rendered.

Shared by test_lab.py (the widgets notebook) and test_lessons.py (every lesson). What the page is asked
lives in ``lab_probe.js``, installed as ``window.ampvizProbe`` before the page loads. The notebook's
session is created through the REST API first (``Lab.start_session``); a run that stalls (queued cells
dropped while the page connected to a kernel) is recovered with a new session and a reload, up to
``attempts`` times; a cell that raises fails at once.
"""

from __future__ import annotations

import time
from pathlib import Path

from playwright.sync_api import TimeoutError as PlaywrightTimeout

PROBE = Path(__file__).with_name("lab_probe.js")


class Clock:
    """Prints elapsed seconds per phase (shown by pytest when the test fails, or with -s)."""

    def __init__(self):
        self.start = time.monotonic()

    def __call__(self, what: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {what}", flush=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def open_notebook(page, lab, notebook: str) -> None:
    """Load the notebook page and wait for its kernel (the session's) to be idle."""
    if not getattr(page, "ampviz_probe", False):
        page.add_init_script(path=str(PROBE))
        page.ampviz_probe = True
    page.goto(lab.lab_url(notebook), wait_until="domcontentloaded")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=90_000)
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook-ExecutionIndicator[data-status='idle']",
                           timeout=90_000)
    panels = page.locator(".jp-NotebookPanel").count()
    assert panels == 1, f"{panels} notebooks open in the page: another test's workspace was restored"


def click_run_all(page, attempts: int = 6) -> None:
    """Run > Run All Cells; a click while the kernel websocket still connects can be dropped,
    so check that execution started (a prompt shows [*] or [n]) and retry if not."""
    page.locator(".jp-NotebookPanel .jp-Cell .jp-InputPrompt").first.click()   # focus the notebook
    started = ("() => Array.from(document.querySelectorAll('.jp-NotebookPanel .jp-InputPrompt'))"
               ".some((e) => /\\[(\\*|\\d+)\\]/.test(e.textContent))")
    for _ in range(attempts):
        page.click(".lm-MenuBar-itemLabel:text-is('Run')")
        page.locator(".lm-Menu-item:has(.lm-Menu-itemLabel:text-is('Run All Cells'))").first.click()
        try:
            page.wait_for_function(started, timeout=5_000)
            return
        except PlaywrightTimeout:
            page.keyboard.press("Escape")
    raise AssertionError(f"Run All Cells did not start execution after {attempts} attempts")


def run_all(page, lab, notebook: str, clock: Clock, raises=(), timeout_s: float = 240, attempts: int = 3) -> None:
    """Run All until every code cell ran, then until every widget and graph rendered; fail with the
    traceback of a cell that raised unless its index is in ``raises`` (tagged raises-exception)."""
    for attempt in range(attempts):
        click_run_all(page)
        clock(f"execution started (attempt {attempt + 1})")
        outcome = page.wait_for_function("(raises) => window.ampvizProbe.outcome(raises)", arg=list(raises),
                                         timeout=timeout_s * 1000, polling=500).json_value()
        if outcome["state"] != "stalled":
            break
        status = page.evaluate("() => document.querySelector('.jp-StatusBar-Widget')?.textContent")
        clock(f"execution stalled (status bar: {status!r}; server: {lab.kernel_events()}): new session, "
              "reload, Run All again")
        page.replaced_kernel = True     # its requests in flight end as "Canceled future" page errors
        lab.end_sessions(notebook)
        lab.start_session(notebook)
        open_notebook(page, lab, notebook)
        if getattr(page, "console_errors", None):      # the replaced kernel's, not the notebook's: say, then drop
            clock(f"console errors while the run stalled: {page.console_errors}")
            page.console_errors.clear()
    if outcome["state"] == "error":
        raise AssertionError(f"{notebook}: a cell raised:\n" + "\n".join(
            f"cell {index}: ...{text}" for index, text in outcome["cells"]))
    assert outcome["state"] == "done", f"{notebook} did not finish after {attempts} Run All attempts"
    rendered = page.wait_for_function("() => window.ampvizProbe.rendered()", timeout=120_000,
                                      polling=500).json_value()
    assert not rendered["broken"], f"{notebook}: widgets failed to display: {rendered['broken']}"

"""ampviz's widgets in a real JupyterLab in headless Chromium: they render, and sliders move plots.

Opens ``widgets.ipynb`` (which displays each widget in a container tagged with the CSS class
``ampviz-test-<Name>``), runs all cells, waits for the plotly graphs, then for each widget
focuses its first slider's handle and presses End / Home / ArrowLeft: the slider's readout and
the plotly figure in the page (data, title, annotations or shapes, read from the
``.js-plotly-plot`` elements) must change. A widget without a slider (DtypeExplorer) gets a click
on its last toggle button (a bit) instead. Screenshots go to pytest's tmp dir.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from .notebook_page import Clock, click_run_all, open_notebook, run_all

NOTEBOOK = "widgets.ipynb"
WIDGETS = ["DtypeExplorer", "ScaleExplorer", "ScalerPlayground", "RunDashboard"]
DONE_TEXT = "all widgets displayed"

# A fingerprint of every plotly graph inside a container (lab_probe.js): per trace, a summary of its data,
# plus titles, annotations, shapes and axis ranges. Two fingerprints differ when the figure visibly changed;
# both are JSON written by the page (Python's json writes some numbers differently).
FINGERPRINT = "(container) => JSON.stringify(window.ampvizProbe.figures(container))"


def _move_first_slider(page, container, shots, name: str) -> None:
    """End (Home if the handle is already at its maximum), then ArrowLeft: readout and figure change."""
    slider = container.locator(".widget-slider").first
    handle, readout = slider.locator(".noUi-handle").first, slider.locator(".widget-readout").first
    at_max = handle.get_attribute("aria-valuenow") == handle.get_attribute("aria-valuemax")
    for key in ("Home" if at_max else "End", "ArrowLeft"):
        text, figure = readout.inner_text(), container.evaluate(FINGERPRINT)
        handle.focus()
        page.keyboard.press(key)
        page.wait_for_function("([el, before]) => el.textContent.trim() !== before",
                               arg=[readout.element_handle(), text.strip()], timeout=10_000)
        page.wait_for_function(f"([el, before]) => ({FINGERPRINT})(el) !== before",
                               arg=[container.element_handle(), figure], timeout=30_000)
        container.screenshot(path=str(shots / f"{name}_after_{key}.png"))


def _click_a_toggle(page, container, shots, name: str) -> None:
    """For widgets without a slider: clicking the last toggle button (a bit) changes the figure."""
    figure = container.evaluate(FINGERPRINT)
    container.locator(".widget-toggle-button").last.click()
    page.wait_for_function(f"([el, before]) => ({FINGERPRINT})(el) !== before",
                           arg=[container.element_handle(), figure], timeout=30_000)
    container.screenshot(path=str(shots / f"{name}_after_click.png"))


@pytest.mark.browser
@pytest.mark.slow
def test_widgets_render_and_sliders_update_plots(lab, page, tmp_path):
    shots = tmp_path / "screenshots"
    shots.mkdir()
    clock = Clock()
    lab.start_session(NOTEBOOK)
    clock("session and kernel started")
    open_notebook(page, lab, NOTEBOOK)
    clock("notebook open")
    try:
        run_all(page, lab, NOTEBOOK, clock)
        assert page.get_by_text(DONE_TEXT).count(), "the last cell's marker is not shown"
        clock("all cells ran")
        for name in WIDGETS:
            container = page.locator(f".ampviz-test-{name}").first
            container.locator(".js-plotly-plot .main-svg").first.wait_for(timeout=90_000)
            container.scroll_into_view_if_needed()
            container.screenshot(path=str(shots / f"{name}_before.png"))
            assert container.evaluate(FINGERPRINT) != "[]", f"{name}: no plotly graph in the page"
            if container.locator(".widget-slider .noUi-handle").count():
                _move_first_slider(page, container, shots, name)
                clock(f"{name}: rendered; its slider changed the figure")
            else:
                assert container.locator(".widget-toggle-button").count(), f"{name}: no slider, no toggle"
                _click_a_toggle(page, container, shots, name)
                clock(f"{name}: rendered; a toggle changed the figure")
    finally:
        page.screenshot(path=str(shots / "page.png"), full_page=True)
        print(f"screenshots in {shots}")
    assert not page.errors, f"errors in the page: {page.errors[:5]}"


@pytest.mark.browser
@pytest.mark.slow
def test_a_stalled_run_can_reopen_the_notebook_it_left_with_unsaved_outputs(lab, page):
    # the stall recovery above reloads the page; the run left outputs unsaved, so JupyterLab asks "leave the
    # page?" (beforeunload), and a dismissed dialog aborted the reload (seen in a full suite under load)
    lab.start_session(NOTEBOOK)
    open_notebook(page, lab, NOTEBOOK)
    click_run_all(page)
    page.wait_for_selector(".jp-NotebookPanel.jp-mod-dirty, .jp-mod-dirty", timeout=60_000)
    open_notebook(page, lab, NOTEBOOK)
    assert page.dialogs[-1:] == ["beforeunload: "] and "widgets.ipynb" in page.url


def test_widget_notebook_is_stripped_and_shows_every_widget():
    """No browser needed: the notebook this test drives is committed stripped and tags each widget."""
    nb = nbformat.read(Path(__file__).with_name(NOTEBOOK), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "strip the notebook's outputs"
    assert "widgets" not in nb.metadata and nb.metadata.kernelspec.name == "python3"
    for name in WIDGETS:
        assert any(f'add_class("ampviz-test-{name}")' in c.source for c in code), f"{name} is not displayed"
    assert DONE_TEXT in code[-1].source

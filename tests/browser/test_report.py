"""The HTML report opens with no network: every figure renders in Chromium with all requests blocked."""

import pytest

from ampviz.demo import train_demo
from ampviz.report import write_report


@pytest.mark.browser
def test_report_renders_every_figure_offline(page, tmp_path):
    run = train_demo(steps=30, device="cpu", progress=False)
    path = write_report([run], tmp_path / "report.html", labels=["demo"])
    expected = path.read_text().count("Plotly.newPlot(")
    requests = []

    def only_the_file(route):
        requests.append(route.request.url)
        if route.request.url.startswith("file:"):
            route.continue_()
        else:
            route.abort()
    page.route("**/*", only_the_file)
    page.goto(path.as_uri())
    page.wait_for_function("(n) => document.querySelectorAll('.js-plotly-plot .main-svg').length >= n",
                           arg=expected, timeout=60_000)
    page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
    assert expected >= 3
    assert page.locator(".js-plotly-plot").count() == expected
    assert [u for u in requests if not u.startswith("file:")] == []
    assert not page.errors, page.errors

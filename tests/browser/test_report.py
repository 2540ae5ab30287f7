"""The HTML report in Chromium: every figure renders offline, a report of a hostile run runs none of its
strings, and long tensor names in the per-tensor panels never overlap."""

import subprocess
import sys

import numpy as np
import pytest

from ampviz import histogram as H
from ampviz.demo import train_demo
from ampviz.report import SMALL_MULTIPLES, report_html, write_report
from ampviz.run import Run

ATTACKS = ['weight"><img src=x onerror=alert(document.title)>', "</script><script>alert('script')</script>",
           "<img src=x onerror=confirm(1)>", "javascript:alert(1)", "%{x}<b onmouseover=alert(2)>bold</b>",
           "<a href=\"javascript:alert('link')\">click</a>", "fc\u202e.txt", "' onload='alert(3)"]


def drawn(page, path, timeout=90_000) -> int:
    """Open ``path`` and wait until every plotly figure of it has drawn; the number of figures."""
    expected = path.read_text().count("Plotly.newPlot(")
    page.goto(path.as_uri())
    page.wait_for_function("(n) => document.querySelectorAll('.js-plotly-plot .main-svg').length >= n",
                           arg=expected, timeout=timeout)
    return expected


def run_with_names(names, kinds=None, steps=6, device="cpu") -> Run:
    """A valid two-rank-free run whose tensors are named ``names``; some values flush in fp16."""
    T = len(names)
    rng = np.random.default_rng(0)
    counts = np.zeros((1, steps, T, H.NBINS), dtype=np.int64)
    for t in range(T):
        centre = H.column(int(rng.integers(-36, -10)))
        counts[0, :, t, centre - 3:centre + 4] = rng.integers(1, 500, (steps, 7))
    scale = np.full((1, steps), 2.0 ** 10)
    return Run(np.arange(steps), rng.random((1, steps)), scale, scale, np.zeros((1, steps), bool), np.arange(steps),
               counts, list(names), kinds or ["weight"] * T, ["torch.float32"] * T,
               {"ranks": [0], "world_size": 1, "every": 1, "device": device, "torch_version": ATTACKS[1],
                "domains": {"weight": "unscaled", "activation": "scaled"}})


@pytest.mark.browser
def test_report_renders_every_figure_offline(page, tmp_path):
    run = train_demo(steps=30, device="cpu", progress=False)
    path = write_report([run], tmp_path / "report.html", labels=["demo"])
    requests = []

    def only_the_file(route):
        requests.append(route.request.url)
        if route.request.url.startswith("file:"):
            route.continue_()
        else:
            route.abort()
    page.route("**/*", only_the_file)
    expected = drawn(page, path, timeout=60_000)
    page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
    assert expected >= 3
    assert page.locator(".js-plotly-plot").count() == expected
    assert [u for u in requests if not u.startswith("file:")] == []
    assert not page.errors, page.errors


@pytest.mark.browser
def test_a_report_of_a_hostile_run_runs_none_of_its_strings(page, tmp_path):
    """Names, device, metadata and the file name itself carry script; the real command writes the report
    (one small-multiples run, and one past SMALL_MULTIPLES tensors that gets the tensor map)."""
    few = run_with_names(ATTACKS, device=ATTACKS[0])
    many = run_with_names([f"{ATTACKS[i % len(ATTACKS)]}.{i}" for i in range(SMALL_MULTIPLES + 6)])
    a = few.save(tmp_path / 'a"><img src=x onerror=alert(document.domain)>.npz')[0]
    b = many.save(tmp_path / "b.npz")[0]
    out = tmp_path / "hostile.html"
    done = subprocess.run([sys.executable, "-m", "ampviz", "report", str(a), str(b), "-o", str(out),
                           "--title", "<script>alert('title')</script>"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    # defence in depth: a kind changed after validation still cannot reach an id or a title raw
    tampered = run_with_names(["w"])
    tampered.tensor_kinds[0] = ATTACKS[0]
    (tmp_path / "tampered.html").write_text(report_html([tampered]))
    for path in (out, tmp_path / "tampered.html"):
        drawn(page, path)
        page.mouse.move(400, 600)
        page.wait_for_timeout(300)
        assert page.dialogs == [], page.dialogs
        assert not page.errors, page.errors
        assert page.evaluate("document.querySelectorAll('[onerror], [onload], [onmouseover]').length") == 0
        assert page.evaluate("[...document.querySelectorAll('a[href]')].filter("
                             "a => a.href.startsWith('javascript:')).length") == 0
    drawn(page, out)
    assert page.title() == page.locator("h1").inner_text() == "<script>alert('title')</script>"
    shown = page.locator("#run0-tensors").text_content() + page.locator("table.summary").first.inner_text()
    assert ATTACKS[0][:20] in shown and "<img src=x onerror=confirm(1)>" in shown     # shown as text, literally
    assert page.locator("#run1-tensor-map").count() == 1 and page.locator("#run1-tensors").count() == 1


@pytest.mark.browser
@pytest.mark.parametrize("tensors", [12, SMALL_MULTIPLES + 6])
def test_long_tensor_names_never_overlap_in_the_per_tensor_panels(page, tmp_path, tensors):
    names = [f"model.transformer.h.{i}.attn.c_attn.lora_A.default.weight_with_a_very_long_suffix_{i}"
             for i in range(tensors)]
    path = write_report([run_with_names(names)], tmp_path / "long.html")
    drawn(page, path)
    boxes = page.evaluate("""() => [...document.querySelectorAll('#run0-tensors .annotation-text')]
        .map(e => e.getBoundingClientRect()).map(r => [r.left, r.top, r.right, r.bottom])""")
    figure = page.evaluate("(() => { const r = document.querySelector('#run0-tensors .main-svg')"
                           ".getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; })()")
    assert len(boxes) >= min(tensors, SMALL_MULTIPLES)
    for i, a in enumerate(boxes):
        assert figure[0] <= a[0] and a[2] <= figure[2], f"title {i} runs off the figure: {a} vs {figure}"
        for j, b in enumerate(boxes[:i]):
            overlap = min(a[2], b[2]) - max(a[0], b[0]) > 0 and min(a[3], b[3]) - max(a[1], b[1]) > 0
            assert not overlap, f"titles {j} and {i} overlap: {b} and {a}"
    assert not page.errors, page.errors

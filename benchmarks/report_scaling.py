"""Time of ``ampviz report`` against the number of tensors: 50, 200 and 1,000 tensors, 10,000 steps, 2 ranks.

    python benchmarks/report_scaling.py                      # 50, 200, 1000 tensors
    python benchmarks/report_scaling.py --tensors 50 200 --browser

Each run is synthetic (``widget_latency.synthetic_run``: drifting bell-shaped histograms, a real
TorchPolicy replay for the loss scale, 1% overflowing steps) and shaped as a Recorder with its
default ``max_bytes`` (256 MiB of histograms per rank) would leave it after 10,000 steps: scalars for
every step, histograms every ``every`` steps, ``every`` doubled until they fit. The run is saved as
two rank files, then timed as the command runs it: load (with validation), build the page (the
doctor's findings included; their share is printed beside), write it. With ``--browser``, Chromium
opens each page and the time until every figure is drawn is printed too.

The ratio column divides each time per tensor by the 50-tensor run's: about 1 or below means the
report grows at most linearly in tensors (it was quadratic: ~125 s at 200 tensors).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from widget_latency import recorder_every, synthetic_run  # noqa: E402

from ampviz.report import write_report  # noqa: E402
from ampviz.run import Run  # noqa: E402

GOAL_S = 15.0


def timed(fn, *args, **kwargs):
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t


def browser_seconds(page_path: Path) -> float:
    """Seconds from navigation until every plotly figure of the page has drawn, in headless Chromium."""
    from playwright.sync_api import sync_playwright
    chromium = os.environ.get("AMPVIZ_CHROMIUM", "/usr/bin/chromium")
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    expected = page_path.read_text().count("Plotly.newPlot(")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=args)
        page = browser.new_page(viewport={"width": 1280, "height": 1800})
        start = time.perf_counter()
        page.goto(page_path.as_uri())
        page.wait_for_function("(n) => document.querySelectorAll('.js-plotly-plot .main-svg').length >= n",
                               arg=expected, timeout=300_000)
        seconds = time.perf_counter() - start
        browser.close()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, nargs="+", default=[50, 200, 1000])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--browser", action="store_true", help="also time the page's first draw in Chromium")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tensors in args.tensors:
            every = recorder_every(args.steps, tensors)
            run = synthetic_run(args.steps, tensors, args.ranks, hist_every=every)
            run.save(Path(tmp) / f"t{tensors}")
            loaded, load_s = timed(Run.load, Path(tmp) / f"t{tensors}")
            _, doctor_s = timed(loaded.diagnose)
            page = Path(tmp) / f"t{tensors}.html"
            _, report_s = timed(write_report, [loaded], page, labels=[f"{tensors} tensors"])
            draw_s = browser_seconds(page) if args.browser else None
            rows.append((tensors, every, loaded.hist_steps.size, load_s, report_s, doctor_s, page.stat().st_size,
                         draw_s))
            del run, loaded
    base = (rows[0][3] + rows[0][4]) / rows[0][0]
    print(f"{args.ranks} ranks x {args.steps:,} steps; histograms every `every` steps (a Recorder's default "
          f"max_bytes); load avg {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'tensors':>7} {'every':>5} {'hist':>5} {'load s':>7} {'report s':>8} {'(doctor s)':>10} {'total s':>7} "
          f"{'per-tensor ratio':>16} {'page MB':>7}" + (f" {'draw s':>6}" if args.browser else ""))
    for tensors, every, hist, load_s, report_s, doctor_s, size, draw_s in rows:
        total = load_s + report_s
        flag = "" if total <= GOAL_S else f"  > {GOAL_S:.0f} s goal"
        print(f"{tensors:7d} {every:5d} {hist:5d} {load_s:7.2f} {report_s:8.2f} {doctor_s:10.2f} {total:7.2f} "
              f"{total / tensors / base:16.2f} {size / 1e6:7.1f}" + (f" {draw_s:6.1f}" if draw_s is not None else "")
              + flag)


if __name__ == "__main__":
    main()

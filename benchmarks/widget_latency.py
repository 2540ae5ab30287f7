"""Python-side update latency of every ampviz widget control, on a run of 2,000 steps × 50 tensors.

    python benchmarks/widget_latency.py                 # 2,000 steps, 50 tensors, 2 ranks
    python benchmarks/widget_latency.py --steps 10000 --tensors 1000      # LLM scale (issue 12)
    python benchmarks/widget_latency.py --steps 500 --repeats 20

Builds a synthetic Run of the requested size (counts arrays of the real shape and dtype:
(ranks, histogram steps, tensors, 257) int64, histograms every ``every`` steps where a Recorder with
its default ``max_bytes`` would end (every step up to 256 MiB per rank, then every 2nd, 4th, ...);
half weight gradients stored unscaled, half activation gradients stored scaled; the loss scale is
a real TorchPolicy replay over the run's own maxima), constructs each widget, then sets each
control many times and prints the median and maximum time
of one update: the observer, the in-place figure changes inside ``batch_update`` and the widget
state serialisation ipywidgets does on every change. The browser's redraw is not included.

The first change of a dashboard selector fills a cache (that selection's counts and heatmap);
its time is reported as "cold", separately from the warm updates.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import time

import numpy as np

from ampviz import histogram as H
from ampviz.lessons.bits import DtypeExplorer
from ampviz.replay import TorchPolicy, replay
from ampviz.run import Run
from ampviz.widgets import RunDashboard, ScaleExplorer, ScalerPlayground

BUDGET_MS = 50.0
RECORDER_MAX_BYTES = 256 << 20          # Recorder's default bound on the histograms kept per rank


def recorder_every(steps: int, tensors: int, max_bytes: int = RECORDER_MAX_BYTES) -> int:
    """The histogram interval a Recorder ends at after ``steps`` steps: ``every`` doubles (decimation)
    while the histograms would exceed ``max_bytes`` (257 int64 bins per tensor per recorded step)."""
    every = 1
    while math.ceil(steps / every) * tensors * H.NBINS * 8 > max_bytes:
        every *= 2
    return every


def synthetic_run(steps: int, tensors: int, ranks: int, seed: int = 0, hist_every: int = 1) -> Run:
    """Bell-shaped binade histograms whose centres drift per tensor and step, with a few inf steps.

    Scalars (loss, loss scale, skipped) for every step; histograms every ``hist_every`` steps, as a
    Recorder keeps them. Only the histogram steps are ever materialised: (H, T, 257) per rank.
    """
    rng = np.random.default_rng(seed)
    k = np.arange(H.K_MIN, H.K_MAX + 1)                                  # binade exponents
    kinds = ["weight" if t < tensors // 2 else "activation" for t in range(tensors)]
    drift = np.cumsum(rng.normal(0, 0.05, (steps, tensors)).astype(np.float32), axis=0)    # (steps, tensors)
    centre0, width = rng.uniform(-30, -8, tensors), rng.uniform(2, 5, tensors)
    trace = np.ldexp(1.0, np.ceil((centre0 + drift).max(axis=1) + 2 * width.max()).astype(int))   # per-step maxima
    trace[rng.random(steps) < 0.01] = np.inf
    r = replay(TorchPolicy(init_scale=2.0 ** 16, growth_interval=100), trace)
    log2s = np.rint(np.log2(r.scale)).astype(np.int64)
    hist_steps = np.arange(0, steps, hist_every)
    sizes = rng.integers(1_000, 200_000, tensors)
    counts = np.zeros((ranks, hist_steps.size, tensors, H.NBINS), dtype=np.int64)
    for start in range(0, hist_steps.size, 64):                          # a block of steps at a time: bounded memory
        rows = hist_steps[start:start + 64]
        centre = centre0[None, :] + drift[rows]                          # (rows, tensors)
        shape = np.exp(-0.5 * ((k[None, None, :] - centre[:, :, None]) / width[None, :, None]) ** 2)
        base = np.rint(shape / shape.sum(axis=2, keepdims=True) * sizes[None, :, None]).astype(np.int64)
        block = counts[:, start:start + rows.size]                       # (ranks, rows, tensors, NBINS) view
        block[..., 2:H.ABOVE] = base
        block[..., H.ZERO] = sizes // 20
        block[:, r.skipped[rows], 0, H.ABOVE] = 1                         # the overflowing steps hold an inf
        half = tensors // 2                                              # activations: stored scaled
        block[:, :, half:] = H.shift(block[:, :, half:], log2s[rows][None, :, None])
    nxt = np.append(r.scale[1:], r.scale[-1])
    meta = {"world_size": ranks, "ranks": list(range(ranks)), "every": hist_every,
            "domains": {"weight": "unscaled", "activation": "scaled"},
            "scaler": {"init_scale": 2.0 ** 16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 100}}
    tile = lambda a: np.repeat(np.asarray(a)[None], ranks, axis=0)     # noqa: E731
    return Run(np.arange(steps), tile(rng.random(steps)), tile(r.scale), tile(nxt), tile(r.skipped),
               hist_steps, counts, [f"layer{t}.{'grad' if kinds[t] == 'weight' else 'out'}" for t in
                                    range(tensors)], kinds, ["torch.float32"] * tensors, meta)


def timed(set_value, values) -> list:
    """(wall, cpu) milliseconds of each ``set_value(v)``; cpu is this process's CPU time, which other
    processes competing for the cores do not inflate."""
    out = []
    for v in values:
        t, c = time.perf_counter(), time.process_time()
        set_value(v)
        out.append(((time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3))
    return out


def report(rows: list) -> None:
    print(f"{'widget':18s} {'control':18s} {'n':>3s} {'median':>7s} {'p90':>6s} {'max':>6s} {'cpu med':>8s} "
          f"{'cpu max':>8s} {'cold':>6s}   (ms; cold = first visit, fills a cache)")
    for widget, control, times, cold in rows:
        wall, cpu = np.array([t[0] for t in times]), np.array([t[1] for t in times])
        flag = "" if np.median(wall) <= BUDGET_MS else f"  median > {BUDGET_MS:.0f} ms"
        cold_text = f"{cold[0]:6.0f}" if cold is not None else f"{'':6s}"
        print(f"{widget:18s} {control:18s} {len(times):3d} {np.median(wall):7.1f} {np.percentile(wall, 90):6.1f} "
              f"{wall.max():6.1f} {np.median(cpu):8.1f} {cpu.max():8.1f} {cold_text}{flag}")


def setter(widget, name):
    control = getattr(widget, name)
    return lambda v: setattr(control, "value", v)


def bench_dtype(n: int) -> list:
    w = DtypeExplorer(0.1, "fp16")
    rng = np.random.default_rng(1)
    rows = [("DtypeExplorer", "value_box", timed(setter(w, "value_box"), [repr(float(v)) for v in
                                                                           np.exp2(rng.uniform(-30, 15, n))]), None)]
    bits = [w.bit_buttons[i % len(w.bit_buttons)] for i in range(n)]
    rows.append(("DtypeExplorer", "bit toggle", timed(lambda b: setattr(b, "value", not b.value), bits), None))
    formats = list(itertools.islice(itertools.cycle(["bf16", "fp8_e4m3fn", "fp32", "fp16"]), n))
    rows.append(("DtypeExplorer", "format_dropdown", timed(setter(w, "format_dropdown"), formats), None))
    return rows


def bench_scale(run: Run, n: int) -> list:
    t = time.perf_counter()
    w = ScaleExplorer(run)
    build = (time.perf_counter() - t) * 1e3
    values = list(np.random.default_rng(2).integers(w.slider.min, w.slider.max + 1, n))
    rows = [("ScaleExplorer", "slider", timed(setter(w, "slider"), [int(v) for v in values]), None)]
    formats = list(itertools.islice(itertools.cycle(["bf16", "fp8_e5m2", "fp16"]), n))
    times = timed(setter(w, "format_dropdown"), formats)
    rows.append(("ScaleExplorer", "format_dropdown", times[3:], max(times[:3])))   # first use tabulates the format
    print(f"ScaleExplorer built in {build:.0f} ms")
    return rows


def bench_playground(run: Run, n: int) -> list:
    t = time.perf_counter()
    w = ScalerPlayground(run)
    print(f"ScalerPlayground built in {(time.perf_counter() - t) * 1e3:.0f} ms")
    rng = np.random.default_rng(3)
    rows = []
    for name, values in (("policy_dropdown", itertools.cycle(["deepspeed", "megatron", "static", "pytorch"])),
                         ("init_slider", (int(v) for v in rng.integers(0, 41, n))),
                         ("growth_slider", (float(v) for v in rng.choice(np.arange(1.25, 8.01, 0.25), n))),
                         ("backoff_slider", (float(v) for v in rng.choice(np.arange(0.05, 0.951, 0.05), n))),
                         ("interval_slider", (int(v) for v in rng.choice(w.interval_slider.options, n))),
                         ("hysteresis_slider", (int(v) for v in rng.integers(1, 11, n)))):
        if name == "hysteresis_slider":
            w.policy_dropdown.value = "megatron"            # a policy that reads it
        rows.append(("ScalerPlayground", name, timed(setter(w, name), list(itertools.islice(values, n))), None))
    return rows


def bench_dashboard(run: Run, n: int) -> list:
    t = time.perf_counter()
    d = RunDashboard(run)
    print(f"RunDashboard built in {(time.perf_counter() - t) * 1e3:.0f} ms")
    steps = [int(v) for v in np.random.default_rng(4).choice(run.hist_steps, n)]
    rows = [("RunDashboard", "step_slider", timed(setter(d, "step_slider"), steps), None)]
    for name, options in (("kind_buttons", ["activation", "weight", "all"]),
                          ("tensor_dropdown", list(d.tensor_dropdown.options[1:4]) + ["all tensors"]),
                          ("rank_dropdown", list(run.ranks[1:]) + [run.ranks[0]]),
                          ("domain_buttons", ["scaled", "unscaled"])):
        cold = timed(setter(d, name), options)                       # first visit of each selection
        warm = timed(setter(d, name), list(itertools.islice(itertools.cycle(options), n)))
        getattr(d, name).value = options[-1]                         # back to the start: all tensors, rank 0
        rows.append(("RunDashboard", name, warm, max(cold)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--tensors", type=int, default=50)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=40, help="updates timed per control")
    ap.add_argument("--hist-every", type=int, default=None,
                    help="histograms every N steps (default: where a Recorder with its default max_bytes ends)")
    args = ap.parse_args()
    every = args.hist_every or recorder_every(args.steps, args.tensors)
    t = time.perf_counter()
    run = synthetic_run(args.steps, args.tensors, args.ranks, hist_every=every)
    print(f"synthetic run: {args.ranks} ranks × {args.steps} steps × {args.tensors} tensors, histograms every "
          f"{every} steps ({run.hist_steps.size} × {H.NBINS} bins: {run.counts.nbytes / 2 ** 20:.0f} MiB of counts), "
          f"{run.skipped[0].sum()} skipped steps, made in {time.perf_counter() - t:.1f} s")
    rows = bench_dtype(args.repeats) + bench_scale(run, args.repeats) + bench_playground(run, args.repeats)
    rows += bench_dashboard(run, args.repeats)
    report(rows)
    medians = [statistics.median(t[0] for t in r[2]) for r in rows]
    cpu = [statistics.median(t[1] for t in r[2]) for r in rows]
    print(f"slowest control, median: {max(medians):.1f} ms wall, {max(cpu):.1f} ms cpu (budget {BUDGET_MS:.0f} ms); "
          f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()

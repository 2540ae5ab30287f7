"""What one update capture (``Recorder(..., updates=N)``) costs: a recorded optimizer step against an unrecorded one.

    python benchmarks/update_cost.py                   # 4 x Linear(1024, 1024): 4.2M fp32 weights, AdamW, CPU
    python benchmarks/update_cost.py --width 512 --repeats 9 --profile

Builds capture_overhead.py's MLP, installs the update capture's optimizer hooks directly (no other recording) and
alternates, step after step, an armed step (the pre-hook copies the weights and, with AdamW, its ``exp_avg`` and
``exp_avg_sq``; the post-hook counts; ``--optimizer sgd``: plain SGD, no state, the weights alone) and an unarmed
one (the hooks return at once). Each line gives the median over ``--repeats`` pairs of the training step (forward,
backward, ``opt.step()``) and of ``opt.step()`` alone, the capture's hooks' own time (and the armed minus the
unarmed step), per million weights, and as a ratio to an unrecorded training step of the same run:
with ``updates=N`` the capture's share of training time is that ratio / N. ``--profile`` prints torch.profiler's
top operators of one armed step; ``--piece`` sets how many elements are measured at once (a loaded machine shows
why ampviz keeps them below torch's intra-op grain size).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from capture_overhead import make_workload

import ampviz
from ampviz.record import _updates
from ampviz.record._updates import UpdateCapture, state_names

hook_seconds = [0.0]                                       # the capture's hooks' time in the current step


def timed_steps(model, opt, batch, loss_fn, capture: UpdateCapture, armed: bool) -> tuple[float, float, float]:
    """(training step, opt.step, the capture's hooks) seconds of one step, the capture armed or not."""
    capture.every = 1 if armed else 1 << 40
    capture.arm(1)                                         # step 1: due only when every is 1
    hook_seconds[0] = 0.0
    start = time.perf_counter()
    loss = loss_fn(model, batch)
    loss.backward()
    mid = time.perf_counter()
    opt.step()
    end = time.perf_counter()
    opt.zero_grad()
    capture.end_step(0)
    capture.pending.clear()                                # rows are not kept: memory stays flat
    return end - start, end - mid, hook_seconds[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024, help="MLP width (4 layers: 4 * (width**2 + width) weights)")
    ap.add_argument("--repeats", type=int, default=15, help="armed / unarmed pairs")
    ap.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    ap.add_argument("--piece", type=int, default=0, help="elements measured at once on the CPU (0: ampviz's)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler's top operators of one armed step")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.piece:
        _updates._CHUNK_CPU = args.piece
    model, batch, loss_fn = make_workload("mlp", width=args.width)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-4) if args.optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=1e-3))
    params = list(model.named_parameters())
    n = sum(p.numel() for _, p in params)
    capture = UpdateCapture(params, 1, torch.device("cpu"), state_names(opt))      # AdamW: its exp_avg, exp_avg_sq
    for name in ("_before", "_after"):                     # the hooks' own time, inside opt.step
        hook = getattr(capture, name)

        def timed_hook(*a, hook=hook, **k):
            start = time.perf_counter()
            out = hook(*a, **k)
            hook_seconds[0] += time.perf_counter() - start
            return out
        setattr(capture, name, timed_hook)
    handles: list = []
    capture.install(opt, handles)
    for armed in (False, True, False, True):               # warm-up: the optimizer's state, the allocator
        timed_steps(model, opt, batch, loss_fn, capture, armed)
    plain, recorded = [], []
    for _ in range(args.repeats):
        plain.append(timed_steps(model, opt, batch, loss_fn, capture, False))
        recorded.append(timed_steps(model, opt, batch, loss_fn, capture, True))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            timed_steps(model, opt, batch, loss_fn, capture, True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    for h in handles:
        h.remove()
    step = statistics.median(t for t, _, _ in plain)
    opt_plain = statistics.median(o for _, o, _ in plain)
    opt_rec = statistics.median(o for _, o, _ in recorded)
    extra = statistics.median(r[0] - p[0] for p, r in zip(plain, recorded))
    hooks = statistics.median(h for _, _, h in recorded)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ampviz {ampviz.__version__}; "
          f"{args.optimizer} MLP width {args.width}: {n / 1e6:.2f}M weights, {args.repeats} pairs (medians)")
    print(f"unrecorded training step {step * 1e3:.1f} ms (opt.step {opt_plain * 1e3:.1f} ms); "
          f"recorded opt.step {opt_rec * 1e3:.1f} ms")
    print(f"one update capture: hooks {hooks * 1e3:.1f} ms = {hooks / step:.2f} unrecorded training steps, "
          f"{hooks * 1e3 / (n / 1e6):.1f} ms per million weights (recorded minus unrecorded step: "
          f"{extra * 1e3:.1f} ms); copies held {capture.copy_bytes / n:.1f} bytes per weight")
    print(f"with updates=100 the capture adds {hooks / step / 100:.2%} to training time")


if __name__ == "__main__":
    main()

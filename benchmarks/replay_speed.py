"""How long a loss-scaler replay takes over a long trace (a ScalerPlayground slider re-runs one).

    python benchmarks/replay_speed.py            # 10,000 steps, every policy, median of 20 runs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from ampviz.replay import DeepSpeedPolicy, MegatronPolicy, StaticPolicy, TorchPolicy, replay


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args(argv)
    # a trace with real structure: log-normal maxima around 2**-8 and occasional spikes
    rng = np.random.default_rng(0)
    trace = rng.lognormal(np.log(2.0 ** -8), 1.5, a.steps)
    trace[rng.random(a.steps) < 0.01] *= 2.0 ** 12
    print(f"replay over {a.steps:,} steps, median of {a.repeats} runs")
    for policy in (TorchPolicy(growth_interval=100), DeepSpeedPolicy(raise_error_at_min_scale=False),
                   MegatronPolicy(), StaticPolicy()):
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            r = replay(policy, trace)
            times.append(time.perf_counter() - t0)
        print(f"{policy.name:<10} {statistics.median(times) * 1e3:6.2f} ms   ({r.n_skipped} skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

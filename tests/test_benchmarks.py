"""Every benchmark runs with its smallest arguments: docs/measured.md's figures come from scripts that still work.

Smoke tests only (the figures they print are not checked: speed is measured by running the scripts on an idle
machine, never by timed unit tests)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALLEST = {
    "block_cost.py": ["--rows", "64", "--cols", "256", "--tensors", "2", "--repeats", "1"],
    "capture_overhead.py": ["--workload", "mlp", "--rounds", "1", "--warmup", "0", "--width", "64"],
    "count_speed.py": ["--steps", "2"],
    "live_export.py": ["--steps", "20", "--every", "10", "--layers", "2"],
    "recorder_memory.py": ["--steps", "50", "--max-mib", "1"],
    "replay_speed.py": ["--steps", "100", "--repeats", "2"],
    "update_cost.py": ["--width", "64", "--repeats", "1", "--profile"],
    "save_cost.py": ["--steps", "6", "--save-every-steps", "2", "--width", "64"],
    "report_scaling.py": ["--tensors", "3", "--steps", "20", "--ranks", "2"],
    "widget_latency.py": ["--steps", "20", "--tensors", "3", "--ranks", "1", "--repeats", "6"],
}


def test_every_benchmark_has_its_smallest_arguments_here():
    assert sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")) == sorted(SMALLEST)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMALLEST))
def test_benchmark_runs(script, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *SMALLEST[script]], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.strip(), f"{script} printed nothing"

"""The Triton counting kernel, checked here without a GPU: the GPU tests run in Triton's interpreter."""

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import frexp_columns

import ampviz
from ampviz._counting import NBINS, Binner, make_counter
from ampviz._counting.cpu_kernels import NumbaCounter
from ampviz._warnings import AmpvizWarning

triton_counter = pytest.importorskip("ampviz._counting.gpu_kernel")
pytestmark = pytest.mark.skipif(not triton_counter.available(), reason="triton is not installed")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_runs_on_the_cpu_as_it_will_on_the_gpu(tmp_path):
    # the dry run of benchmarks/gpu_check.sh: the gpu tests with the kernel in Triton's interpreter (kernel == oracle
    # for every dtype and size; the Recorder counting with it changes no weight), the benchmarks, the recordings
    env = {k: v for k, v in os.environ.items() if k not in ("AMPVIZ_COUNTER", "TRITON_INTERPRET")}
    out = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--device", "cpu", "--out", str(tmp_path)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "gpu_check: every step passed" in out.stdout
    tests = next(line for line in out.stdout.splitlines() if " passed" in line and "deselected" in line)
    assert "failed" not in tests and int(tests.split(" passed")[0].split()[-1]) >= 13, tests
    run = ampviz.Run.load(tmp_path / "gpt2_tiny_fp16.npz")
    assert run.meta["recorded_on"]["torch"] == torch.__version__ and run.n_steps >= 1
    assert {"weight", "activation", "output"} <= set(run.tensor_kinds)


@pytest.mark.parametrize("value, message", [
    ("cuda-fast", "AMPVIZ_COUNTER: expected one of numba, triton, torch"),
    ("triton", "set TRITON_INTERPRET=1"),
])
def test_a_counter_that_cannot_be_had_is_a_clear_error(monkeypatch, value, message):
    monkeypatch.setenv("AMPVIZ_COUNTER", value)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=message):
        make_counter("cpu")


def test_the_counter_is_chosen_by_device_and_by_ampviz_counter(monkeypatch):
    monkeypatch.delenv("AMPVIZ_COUNTER", raising=False)
    assert isinstance(make_counter("cpu"), NumbaCounter)
    monkeypatch.setenv("AMPVIZ_COUNTER", "torch")
    assert isinstance(make_counter("cpu"), Binner)


def test_a_kernel_that_cannot_run_falls_back_to_the_torch_path_once(monkeypatch):
    class Unbuildable:                                     # what a GPU without a working toolchain does
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("ptxas not found")
            return launch
    monkeypatch.setattr(triton_counter, "_histogram_kernel", Unbuildable())
    x = torch.randn(10_000) * 2.0 ** -20
    counter = triton_counter.TritonCounter("cpu", programs=2)
    target = torch.zeros(2 * NBINS, dtype=torch.int64)
    counter.target = target
    with pytest.warns(AmpvizWarning, match="cannot run on cpu .*ptxas not found.*AMPVIZ_COUNTER=torch"):
        counter.add(x, 0)
    counter.add(x.half(), 1)                               # no second warning: the torch path from now on
    counter.submit()
    got = target.view(2, NBINS).numpy()
    np.testing.assert_array_equal(got[0], np.bincount(frexp_columns(x.numpy()), minlength=NBINS))
    np.testing.assert_array_equal(got[1], np.bincount(frexp_columns(x.half().float().numpy()), minlength=NBINS))

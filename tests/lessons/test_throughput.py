"""Throughput measurements: the arithmetic of the reported rates, dtypes really used, clear errors."""

import platform

import pytest
import torch

from ampviz.lessons.throughput import cast_seconds, cpu_features, linear_throughput, matmul_throughput


def test_matmul_rates_are_flops_over_the_median_time():
    rows = matmul_throughput("cpu", dtypes=(torch.float32, torch.bfloat16), n=64, min_run_time=0.02, rounds=2)
    assert [r.dtype for r in rows] == ["float32", "bfloat16"]
    for r in rows:
        assert r.shape == "64x64" and r.flops == 2 * 64 ** 3
        assert r.median_s == r.measurement.median > 0
        assert r.gflops == pytest.approx(r.flops / r.median_s / 1e9)


def test_transposed_layout_times_a_at_b_transposed():
    rows = matmul_throughput("cpu", dtypes=(torch.float32,), n=32, min_run_time=0.02, rounds=1, transpose_b=True)
    assert rows[0].measurement.task_spec.stmt == "a @ b.T" and rows[0].flops == 2 * 32 ** 3


def test_cast_seconds_times_the_cast_of_a_weight():
    assert 0 < cast_seconds("cpu", torch.float16, shape=(64, 64), min_run_time=0.02) < 1
    with pytest.raises(ValueError, match="dtypes"):
        cast_seconds("cpu", torch.int8)


def test_linear_runs_under_autocast_in_the_requested_dtype():
    rows = linear_throughput("cpu", autocast_dtypes=(None, torch.bfloat16), batch=8, features=16,
                             min_run_time=0.02, rounds=1)
    assert [r.dtype for r in rows] == ["float32", "autocast bfloat16"]
    assert all(r.flops == 2 * 8 * 16 * 16 and r.gflops > 0 for r in rows)


@pytest.mark.parametrize("kwargs, match", [
    (dict(device="mps"), "device"), (dict(device="cpu", dtypes=(torch.float64,)), "dtypes"),
    (dict(device="cpu", n=0), "n"), (dict(device="cpu", min_run_time=0), "min_run_time"),
    (dict(device="cpu", rounds=0), "rounds")])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        matmul_throughput(**kwargs)


def test_cpu_features_agree_with_proc_cpuinfo():
    feats = cpu_features()
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        assert feats == {}
        return
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        assert feats == {}
        return
    flags = next(line for line in text.splitlines() if line.startswith("flags")).split(":", 1)[1].split()
    assert feats and all(feats[k] == (k in flags) for k in feats)


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "ppc64le"])
def test_cpu_features_unknown_off_x86(monkeypatch, machine):
    # Lesson 02 asserts "fp16 is slower" only where the x86 flags are known; on an ARM CPU (which has fp16
    # arithmetic of its own) an all-False dict would read as "no fp16 instructions" and trigger that assert.
    monkeypatch.setattr(platform, "machine", lambda: machine)
    assert cpu_features() == {}


def test_cpu_features_unknown_without_a_flags_line(monkeypatch, tmp_path):
    # ARM Linux prints "Features", not "flags": that is unknown, not "none of the flags".
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd fphp asimdhp bf16\n")
    real_open = open
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path,
                                                                          *a, **k))
    assert cpu_features() == {}

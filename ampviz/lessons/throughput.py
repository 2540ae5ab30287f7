"""Measured matrix-multiply speed per dtype on the current device, with ``torch.utils.benchmark``.

Whether 16-bit arithmetic is faster depends on the hardware, so measure instead of assuming::

    >>> import torch
    >>> from ampviz.lessons.throughput import matmul_throughput
    >>> rows = matmul_throughput(torch.device("cpu"), n=128, min_run_time=0.05)
    >>> [r.dtype for r in rows]
    ['float32', 'bfloat16', 'float16']
    >>> rows[0].gflops > 0
    True

The same product can run different kernels: ``nn.Linear`` computes ``x @ W.T`` on a transposed view
of its weight, and on some CPUs that layout picks a much faster 16-bit kernel than ``a @ b`` on two
row-major matrices. ``matmul_throughput(..., transpose_b=True)`` times that layout, and
:func:`cast_seconds` times the cast autocast adds, so a lesson can tell the two effects apart.

On GPUs, 16-bit matrix multiplies run on Tensor Cores (fp16 since Volta, bf16 since Ampere). On
CPUs, bf16 can be fast only with AVX512-BF16 or AMX-BF16 instructions and fp16 only with AMX-FP16 or
AVX512-FP16, and only where the kernel for the operation, size and layout uses them: the
instructions are necessary, not sufficient. :func:`cpu_features` reports which of these flags an x86
CPU has (and nothing on other CPUs); the timings say whether they were used.

Used by lessons 02 (why mixed precision) and appendix_matmul_layouts.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

import torch
from torch.utils import benchmark

__all__ = ["Throughput", "matmul_throughput", "linear_throughput", "cast_seconds", "cpu_features", "DEFAULT_N"]

DEFAULT_N = {"cpu": 256, "cuda": 4096}          # big enough to measure, small enough for a lesson
_X86_MACHINES = ("x86_64", "amd64", "i386", "i686")
_CPU_FLAGS = ("avx2", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")
_DTYPES = {torch.float32, torch.bfloat16, torch.float16}


@dataclass
class Throughput:
    """One measurement: median seconds per call and the rate it implies."""

    dtype: str
    shape: str
    flops: float                                # floating-point operations per call
    median_s: float
    gflops: float
    measurement: benchmark.Measurement


def _check(device, dtypes, min_run_time, rounds):
    device = torch.device(device)
    if device.type not in DEFAULT_N:
        raise ValueError(f"device: expected a cpu or cuda device, got {device}")
    for dt in dtypes:
        if dt not in _DTYPES:
            raise ValueError(f"dtypes: expected float32, bfloat16 or float16, got {dt!r}")
    if not min_run_time > 0:
        raise ValueError(f"min_run_time: expected seconds > 0, got {min_run_time!r}")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds: expected a positive integer, got {rounds!r}")
    return device


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _measure_interleaved(cases, label, shape, flops, min_run_time, rounds):
    """Time each (description, stmt, globals) case; rounds interleave the cases and the fastest
    round counts, so a burst of load from other processes cannot favour one dtype."""
    best: dict[str, benchmark.Measurement] = {}
    for _ in range(rounds):
        for description, stmt, globals_ in cases:
            timer = benchmark.Timer(stmt=stmt, globals=globals_, label=label, sub_label=shape,
                                    description=description, num_threads=torch.get_num_threads())
            m = timer.blocked_autorange(min_run_time=min_run_time / rounds)  # synchronises CUDA
            if description not in best or m.median < best[description].median:
                best[description] = m
    return [Throughput(d, shape, flops, m.median, flops / m.median / 1e9, m) for d, m in best.items()]


def matmul_throughput(device, dtypes=(torch.float32, torch.bfloat16, torch.float16), n: int | None = None,
                      min_run_time: float = 0.3, rounds: int = 3, transpose_b: bool = False) -> list[Throughput]:
    """Time ``a @ b`` for square ``n x n`` matrices stored in each dtype.

    Parameters
    ----------
    device : "cpu" or "cuda" (a torch.device or string).
    dtypes : storage dtypes to compare (float32, bfloat16, float16).
    n : matrix size; default ``DEFAULT_N[device.type]``.
    min_run_time : seconds of timing per dtype, split over ``rounds`` interleaved rounds
        (``Timer.blocked_autorange`` each); the fastest round is kept.
    transpose_b : time ``a @ b.T`` instead (``b.T`` a transposed view: ``nn.Linear``'s layout).
    """
    device = _check(device, dtypes, min_run_time, rounds)
    n = DEFAULT_N[device.type] if n is None else n
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected a positive integer, got {n!r}")
    gen = torch.Generator(device=device).manual_seed(0)
    cases = []
    for dt in dtypes:
        a = torch.randn(n, n, device=device, generator=gen).to(dt)
        b = torch.randn(n, n, device=device, generator=gen).to(dt)
        cases.append((_name(dt), "a @ b.T" if transpose_b else "a @ b", {"a": a, "b": b}))
    return _measure_interleaved(cases, "matmul", f"{n}x{n}", 2.0 * n ** 3, min_run_time, rounds)


def linear_throughput(device, autocast_dtypes=(None, torch.bfloat16, torch.float16), batch: int | None = None,
                      features: int | None = None, min_run_time: float = 0.3, rounds: int = 3) -> list[Throughput]:
    """Time an fp32 ``nn.Linear`` forward plainly (None) and under ``torch.amp.autocast`` per dtype.

    Under autocast the fp32 weight is cast to the low dtype inside the call, so this includes the
    cast that a real autocast forward pays.
    """
    device = _check(device, [d for d in autocast_dtypes if d is not None], min_run_time, rounds)
    features = DEFAULT_N[device.type] if features is None else features
    batch = DEFAULT_N[device.type] if batch is None else batch
    for name, v in (("batch", batch), ("features", features)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected a positive integer, got {v!r}")
    gen = torch.Generator(device=device).manual_seed(0)
    layer = torch.nn.Linear(features, features, device=device)
    x = torch.randn(batch, features, device=device, generator=gen)
    stmt = "with torch.no_grad(), torch.amp.autocast(dev, dtype=dt, enabled=on):\n    layer(x)"
    cases = [("float32" if dt is None else f"autocast {_name(dt)}", stmt,
              {"torch": torch, "layer": layer, "x": x, "dev": device.type, "dt": dt or torch.bfloat16,
               "on": dt is not None}) for dt in autocast_dtypes]
    return _measure_interleaved(cases, "linear", f"{batch}x{features}", 2.0 * batch * features ** 2,
                                min_run_time, rounds)


def cast_seconds(device, dtype: torch.dtype, shape=None, min_run_time: float = 0.1) -> float:
    """Median seconds of ``w.to(dtype)`` for an fp32 ``w`` of ``shape`` (default ``n x n``): the cast
    autocast performs on a weight each time a 16-bit op uses it."""
    device = _check(device, [dtype], min_run_time, 1)
    n = DEFAULT_N[device.type]
    w = torch.randn(*(shape or (n, n)), device=device)
    timer = benchmark.Timer(stmt="w.to(dt)", globals={"w": w, "dt": dtype}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median   # synchronises CUDA


def cpu_features() -> dict[str, bool]:
    """Which 16-bit-relevant x86 instruction sets this CPU reports, from Linux ``/proc/cpuinfo``.

    Empty (``{}``) where that is unknown: a CPU that is not x86 (ARM has 16-bit instructions of its own,
    which these flags do not describe) or a system without ``/proc/cpuinfo`` (macOS, Windows). An empty
    result means "not known", never "none of them".
    """
    if platform.machine().lower() not in _X86_MACHINES:
        return {}
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return {}
    return {} if flags is None else {flag: flag in flags for flag in _CPU_FLAGS}

"""Counting binade histograms where the tensors are: three interchangeable counters behind one interface.

* :class:`~.ops.Binner`: torch ops on any device (keys in a buffer, one ``bincount`` / ``index_add_`` per batch);
* :class:`~.cpu_kernels.NumbaCounter`: numba kernels on the CPU that read each value once;
* :class:`~.gpu_kernel.TritonCounter`: a Triton kernel on the GPU with per-program counts merged once.

Each is a :class:`Counter`; :func:`make_counter` picks the fastest one for a device (``AMPVIZ_COUNTER`` overrides).
The column of a value is the same everywhere (see :mod:`~.ops`); the tests hold every counter against an
independent ``numpy.frexp`` oracle::

    counter = make_counter("cpu")
    counter.target = torch.zeros(rows * NBINS, dtype=torch.int64)   # where counts land, row by row
    counter.add(grad, row); counter.add_many([g1, g2], [0, 1]); counter.submit(); counter.wait()
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from . import cpu_kernels
from .ops import NBINS, Binner, dense_flat, group_offsets, prepare

__all__ = ["Counter", "make_counter", "COUNTERS", "NBINS", "Binner", "dense_flat", "group_offsets", "prepare"]

COUNTERS = ("numba", "triton", "torch")


class Counter(Protocol):
    """What the Recorder and :func:`ampviz.histogram.histograms` need of a counter."""

    target: torch.Tensor | None
    """Flat int64 counts, ``rows * NBINS``, on the counter's device: row ``r`` is ``target[r*NBINS:(r+1)*NBINS]``."""

    def add(self, x: torch.Tensor, row: int) -> None:
        """Count every element of ``x`` into ``row`` (now, or at the next ``submit``)."""

    def add_many(self, tensors: list, rows: list) -> None:
        """Count several tensors, one row each."""

    def add_group(self, tensors: list, rows: list, offsets: torch.Tensor) -> None:
        """Count several small float32 tensors at once (``offsets`` from :func:`group_offsets`)."""

    def submit(self) -> None:
        """Count whatever is buffered into ``target`` (asynchronously on a GPU)."""

    def wait(self) -> None:
        """Block until the host may read what was counted (the CPU counters never run in the background)."""

    def close(self) -> None:
        """Release threads and buffers; a later count starts them again."""


def make_counter(device, capacity: int = 1 << 20) -> Counter:
    """The fastest counter for ``device``: numba on the CPU, the Triton kernel on a GPU, torch ops where neither is
    available. ``AMPVIZ_COUNTER`` (numba, triton or torch) picks one instead: ``torch`` is the fallback if a kernel
    misbehaves; ``triton`` on the CPU needs ``TRITON_INTERPRET=1`` (Triton's interpreter)."""
    device = torch.device(device)
    choice = os.environ.get("AMPVIZ_COUNTER", "").strip().lower()
    if choice and choice not in COUNTERS:
        raise ValueError(f"AMPVIZ_COUNTER: expected one of {', '.join(COUNTERS)} (or unset), got {choice!r}")
    numba = cpu_kernels.available()
    if choice == "numba" and (device.type != "cpu" or not numba):
        raise ValueError(f"AMPVIZ_COUNTER=numba: counts CPU tensors with numba installed; this recording is on "
                         f"{device.type}{'' if numba else ' and numba is not installed'}")
    if choice in ("", "triton") and (device.type == "cuda" or choice == "triton"):
        from . import gpu_kernel
        if choice == "triton" and not gpu_kernel.available():
            raise ValueError("AMPVIZ_COUNTER=triton: triton is not installed")
        if choice == "triton" and device.type == "cpu" and not gpu_kernel.interpreted():
            raise ValueError("AMPVIZ_COUNTER=triton on the CPU runs Triton's interpreter: set TRITON_INTERPRET=1 "
                             "before Python starts")
        if gpu_kernel.available():
            return gpu_kernel.TritonCounter(device)
    if choice in ("", "numba") and device.type == "cpu" and numba:
        return cpu_kernels.NumbaCounter()
    return Binner(device, capacity=capacity)

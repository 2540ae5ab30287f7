"""Fuzzed run files: a few hundred mutations of real run files, whole or saved in appended parts (bytes
flipped, fields of the zip headers set to extreme values, compression methods swapped, pieces cut out or
repeated), each loaded with ``Run.load``. The only exception allowed is RunFileError, in one line naming
the file; no load hangs, and the whole loop stays within the memory budget it is given. Seeds are fixed:
a failure names its seed."""

import random
import struct
import time
import tracemalloc
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest

from ampviz import histogram as H
from ampviz._warnings import AmpvizWarning
from ampviz.run import Run, RunFileError

MUTANTS = 450
BUDGET = 4 << 20                   # AMPVIZ_MAX_RUN_BYTES for the loop: what a mutant may make it allocate


def seed_run(steps=24, tensors=3) -> Run:
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, (1, steps, tensors, H.NBINS)).astype(np.int64)
    scale = np.full((1, steps), 2.0 ** 16)
    return Run(np.arange(steps), rng.random((1, steps)), scale, scale, np.zeros((1, steps), bool), np.arange(steps),
               counts, [f"layer{t}.weight" for t in range(tensors)], ["weight"] * tensors, ["torch.float32"] * tensors,
               {"ranks": [0], "world_size": 1, "every": 1, "domains": {"weight": "unscaled"},
                "scaler": {"init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 5}},
               grad_order=np.zeros((1, steps, tensors), np.int32), scheduler_steps=np.arange(steps)[None])


def appended(path: Path) -> Path:
    """A file a recorder saved three times: parts appended after the first save's end record."""
    import torch
    import torch.nn.functional as F

    import ampviz
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampviz.Recorder(model, opt, path=path, save_every=None, save_every_steps=3) as rec:
        for _ in range(8):
            F.cross_entropy(model(torch.randn(4, 4)), torch.randint(0, 2, (4,))).backward()
            opt.step()
            opt.zero_grad()
            rec.step()
    with zipfile.ZipFile(path) as z:
        assert "counts.2.npy" in z.namelist()
    return path


def seed_files(directory: Path) -> list[bytes]:
    """The files mutated: a run as ampviz saves it (deflated), the same members stored uncompressed (so
    mutations reach the .npy headers and the data directly), and a file of appended parts."""
    saved = seed_run().save(directory / "seed.npz")[0]
    stored = directory / "stored.npz"
    with zipfile.ZipFile(saved) as src, zipfile.ZipFile(stored, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    return [saved.read_bytes(), stored.read_bytes(), appended(directory / "appended.npz").read_bytes()]


def headers(data: bytes) -> list[int]:
    """Offsets of every local header, central directory entry and end record in ``data``."""
    out = []
    for signature in (b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06", b"\x93NUMPY"):
        start = 0
        while (i := data.find(signature, start)) >= 0:
            out.append(i)
            start = i + 1
    return out


EXTREMES = [0, 1, 0x7F, 0xFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 12, 14, 99]


def mutate(data: bytes, rng: random.Random) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(6)
        if kind == 0:                                   # flip a few bytes anywhere
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif kind == 1:                                 # a header field set to an extreme value
            at = rng.choice(headers(bytes(data)) or [0]) + rng.randrange(4, 46)
            fmt, value = rng.choice([("<H", rng.choice(EXTREMES) & 0xFFFF), ("<I", rng.choice(EXTREMES))])
            if at + struct.calcsize(fmt) <= len(data):
                struct.pack_into(fmt, data, at, value)
        elif kind == 2:                                 # truncated
            del data[rng.randrange(1, len(data)):]
        elif kind == 3:                                 # a piece cut out
            a = rng.randrange(len(data))
            del data[a:a + rng.randint(1, 200)]
        elif kind == 4:                                 # a piece repeated
            a = rng.randrange(len(data))
            data[a:a] = data[a:a + rng.randint(1, 200)]
        else:                                           # a .npy header's text rewritten
            i = bytes(data).find(b"'shape': (", rng.randrange(len(data)))
            if i >= 0:
                data[i + 10:i + 12] = rng.choice([b"99", b"-1", b"0,", b"1e", b"))", b"2*"])
        if not data:
            break
    return bytes(data)


def test_fuzzed_run_files_raise_only_run_file_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPVIZ_MAX_RUN_BYTES", str(BUDGET))
    seeds = seed_files(tmp_path)
    outcomes = {"loaded": 0, "refused": 0}
    slowest = 0.0
    tracemalloc.start()
    try:
        for seed in range(MUTANTS):
            rng = random.Random(seed)
            path = tmp_path / f"mutant{seed}.npz"
            path.write_bytes(mutate(seeds[seed % len(seeds)], rng))
            start = time.perf_counter()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", AmpvizWarning)     # e.g. a cut-off tail, left out
                    Run.load(path)
                outcomes["loaded"] += 1
            except RunFileError as e:
                message = str(e)
                assert message.startswith(str(path)) and "\n" not in message, (seed, message)
                outcomes["refused"] += 1
            except Exception as e:                                      # noqa: BLE001 - the point of the test
                pytest.fail(f"seed {seed}: {type(e).__name__}: {e}")
            slowest = max(slowest, time.perf_counter() - start)
            path.unlink()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert outcomes["refused"] > MUTANTS // 2 and outcomes["loaded"] > 0, outcomes
    assert slowest < 10, f"one load took {slowest:.1f} s"
    assert peak < 2 * BUDGET + (16 << 20), f"peak {peak / 1e6:.1f} MB"

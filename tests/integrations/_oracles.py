"""Independent oracles for the integration tests: numpy's frexp binning of captured tensors, and readers of
what TensorBoard and W&B wrote (tensorboard's own EventAccumulator; W&B's record protobuf)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import frexp_columns

import ampviz.histogram as H
from ampviz import AmpvizWarning

needs_cxx = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="inductor needs a C++ compiler")


def with_graph_breaks(train):
    """(what ``train()`` returns, the graph breaks it caused), from a fresh torch.compile state."""
    import torch._dynamo
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    result = train()
    return result, sum(torch._dynamo.utils.counters["graph_break"].values())


@contextlib.contextmanager
def restored_determinism():
    """Put back what ``TrainingArguments(full_determinism=True)`` changes for the whole process (torch's
    deterministic-algorithms switch, cuDNN's flags, five environment variables), so later tests run as before."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    environ = dict(os.environ)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]
        os.environ.clear()
        os.environ.update(environ)


def compiled_with_and_without(compiled, callback, warning: str):
    """Train ``compiled(callbacks)`` without, then with ``callback`` (which must warn ``warning``): no graph break
    either way and the same final weights. Returns the recorded run."""
    plain, plain_breaks = compiled([])
    with pytest.warns(AmpvizWarning, match=warning):
        recorded, breaks = compiled([callback])
    assert breaks == plain_breaks == 0 and params_equal(plain, recorded)
    return callback.run


def binned(*tensors) -> np.ndarray:
    """(NBINS,) counts of every value of ``tensors``, binned with numpy.frexp (not ampviz's kernels)."""
    values = np.concatenate([t.detach().float().cpu().numpy().ravel() for t in tensors])
    return np.bincount(frexp_columns(values), minlength=H.NBINS)


def row_from_buckets(limits, counts, zeros, inf, nan) -> np.ndarray:
    """Rebuild a 257-column row from log2 bucket limits (k + 1 for the binade (2^k, 2^(k+1)]) and the specials."""
    row = np.zeros(H.NBINS, dtype=np.int64)
    for limit, count in zip(limits, counts):
        assert float(limit).is_integer(), limit
        row[int(limit) + 127] += int(count)
    row[H.ZERO], row[H.ABOVE], row[H.NAN] = zeros, inf, nan
    return row


def read_tensorboard(log_dir):
    """tensorboard's own reader over every event file in ``log_dir`` (no size limits)."""
    from tensorboard.backend.event_processing import event_accumulator as ea
    acc = ea.EventAccumulator(str(log_dir), size_guidance={ea.HISTOGRAMS: 0, ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    return acc


def tensorboard_row(acc, prefix, kind, name, step) -> np.ndarray:
    """The 257-column row of one tensor at one step, as TensorBoard stored it."""
    def scalar(special):
        return {e.step: e.value for e in acc.Scalars(f"{prefix}_{special}/{kind}/{name}")}[step]
    hists = {e.step: e.histogram_value for e in acc.Histograms(f"{prefix}_{kind}/{name}")}
    limits, counts = (hists[step].bucket_limit, hists[step].bucket) if step in hists else ([], [])
    return row_from_buckets(limits, counts, scalar("zeros"), scalar("inf"), scalar("nan"))


def wandb_history(wandb_dir, timeout: float = 30.0) -> list[dict]:
    """History rows of the single offline W&B run under ``wandb_dir``, read from its ``.wandb`` file.

    ``run.finish()`` can return before W&B's writer process has written the last records: the file is
    read again until it holds the run's "exit" record. The file is W&B's LevelDB-log format (a 7-byte
    header ":W&B" 0xBEE1 version, then 32 KiB blocks of records: crc32 (4), length (2), type (1: full,
    2: first, 3: middle, 4: last), payload); each payload is a ``wandb_internal_pb2.Record``.
    """
    files = sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    deadline = time.monotonic() + timeout
    while True:
        records = list(_wandb_records(files[0].read_bytes()))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def _wandb_records(data: bytes, block: int = 32768):
    from wandb.proto import wandb_internal_pb2 as pb
    assert data[:4] == b":W&B"
    pos, payload = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:                                  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 or pos + 7 + length > len(data):  # zero padding, or a record still being written
            return
        payload += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(payload)
            payload = b""
            yield record


def wandb_row(history_row, prefix, kind, name) -> np.ndarray:
    """The 257-column row of one tensor in one W&B history row."""
    key = f"{prefix}_{kind}/{name}"
    if f"{key}/bins" in history_row:
        edges, counts = history_row[f"{key}/bins"], history_row[f"{key}/values"]
        limits = edges[1:]
    else:
        limits, counts = [], []
    specials = (history_row[f"{prefix}_{s}/{kind}/{name}"] for s in ("zeros", "inf", "nan"))
    return row_from_buckets(limits, counts, *specials)


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def run_docs_torchrun_script(tmp_path, script: str, **env_extra) -> None:
    """Write the ```text block of docs/integrations.md that starts with ``# <script>`` into ``tmp_path`` and run it as
    written under torchrun on 2 CPU ranks (a free loopback port, this checkout's ampviz first on the path)."""
    import socket
    import subprocess
    import sys

    import ampviz
    text = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    (tmp_path / script).write_text(text.split(f"```text\n# {script}\n", 1)[1].split("\n```", 1)[0])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = str(Path(ampviz.__file__).resolve().parents[1])
    env = dict(os.environ, **env_extra, PYTHONPATH=os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", str(port), script],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]


# DeepSpeed on the CPU: fp16 engines only where its accelerator has fp16 (test_deepspeed, test_transformers_deepspeed)
def _fp16_on_cpu() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())     # what DeepSpeed's CPU accelerator asks
    except Exception:
        return False


FP16 = _fp16_on_cpu()
needs_fp16 = pytest.mark.skipif(not FP16, reason="DeepSpeed's CPU accelerator has no fp16 on this CPU "
                                                 "(no avx512_fp16 / AMX-FP16): fp16 engines are refused")

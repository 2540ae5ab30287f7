"""The Recorder leaves torch's thread count alone and never uses more threads than torch has (issue 10,
defect 1): in a fresh process with OMP_NUM_THREADS=1, in-process with two threads, and under torchrun
with DDP (a BERT with accumulation and no_sync), where training is bit-identical with and without it."""

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampviz

HERE = Path(__file__).parent

SCRIPT = """
import json, torch, torch.nn as nn, torch.nn.functional as F
import ampviz
start = torch.get_num_threads()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 8))   # > 1M values: the parallel path
opt = torch.optim.SGD(model.parameters(), lr=0.1)
inside = []
model[0].register_forward_hook(lambda m, i, o: inside.append(torch.get_num_threads()) and None)
with ampviz.Recorder(model, opt) as rec:
    entered = torch.get_num_threads()
    for _ in range(2):
        F.cross_entropy(model(torch.randn(64, 1024)), torch.randint(0, 8, (64,))).backward()
        opt.step(); opt.zero_grad(); rec.step()
        inside.append(torch.get_num_threads())
print(json.dumps({"start": start, "entered": entered, "inside": inside, "after": torch.get_num_threads(),
                  "counted": int(rec.run.counts.sum())}))
"""


def test_a_fresh_process_with_one_omp_thread_keeps_one():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["start"] == seen["entered"] == seen["after"] == 1 and set(seen["inside"]) == {1}
    assert seen["counted"] > 2 * 1024 * 1024


def test_counting_threads_never_exceed_torchs_and_are_gone_after_close():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 8))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        peak = []

        def watch(m, i, o):
            peak.append(sum(t.name.startswith("ampviz-count") for t in threading.enumerate()))
        model[0].register_forward_hook(watch)
        with ampviz.Recorder(model, opt) as rec:
            rec._recording.counter.min_share = 1 << 16               # split even these 1M values: the pool runs
            for _ in range(3):
                F.cross_entropy(model(torch.randn(64, 1024)), torch.randint(0, 8, (64,))).backward()
                opt.step()
                opt.zero_grad()
                rec.step()
                assert torch.get_num_threads() == 2
        assert max(peak) == 1                                      # the caller's thread + at most one more
        assert not any(t.name.startswith("ampviz-count") for t in threading.enumerate())
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_torchrun_ddp_bert_is_bit_identical_with_and_without_the_recorder(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)                      # torchrun sets it to 1, as for any user
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), str(HERE / "_ddp_worker.py"), str(tmp_path)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    finals = [torch.load(tmp_path / f"bert{r}.pt", weights_only=True) for r in (0, 1)]
    for rank_finals in finals:
        without, with_rec, without_again = rank_finals
        assert all(torch.equal(a, b) for a, b in zip(without, without_again))
        assert all(torch.equal(a, b) for a, b in zip(without, with_rec)), "the recorder changed training"
    assert all(torch.equal(a, b) for a, b in zip(finals[0][1], finals[1][1]))       # DDP kept the ranks equal
    for r in (0, 1):
        threads = json.loads((tmp_path / f"threads{r}.json").read_text())
        assert threads["start"] == 1 and threads["inside"] == [1] and threads["after"] == 1
        assert threads["rows_filled"] == threads["rows"]                        # every recorded row filled

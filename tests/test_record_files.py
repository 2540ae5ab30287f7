"""Nothing recorded is lost (issue 12, items 6-9 and 11): one file per rank under DDP, a save on SIGTERM,
the user's exception kept when the save fails too, save paths checked at Recorder(...), the device ring and
the host store bounded by max_bytes."""

import os
import signal
import socket
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampviz
from ampviz import histogram as H
from ampviz._warnings import AmpvizWarning


def tiny(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def train(model, opt, rec, steps, scheduler=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        rec.step(loss)


# ------------------------------------------------------------------------------------------ item 6
def test_ddp_ranks_given_one_file_path_write_one_file_each(tmp_path):
    import _ddp_worker
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker.run, args=(2, port, str(tmp_path), 2, 3, "run.npz"), nprocs=2, join=True)
    assert sorted(p.name for p in tmp_path.glob("*.npz")) == ["run.rank0.npz", "run.rank1.npz"]
    run = ampviz.Run.load(tmp_path)
    assert run.ranks == [0, 1] and run.n_steps == 3
    assert not np.array_equal(run.counts[0][..., -4:, :], run.counts[1][..., -4:, :])    # local grads differ


# ------------------------------------------------------------------------------------------ item 7
LOOP = """
import sys, torch, torch.nn as nn, torch.nn.functional as F
import ampviz
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with ampviz.Recorder(model, opt, path=sys.argv[1]) as rec:
    step = 0
    while True:
        F.cross_entropy(model(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
        opt.step(); opt.zero_grad(); rec.step()
        step += 1
        if step == 5:
            print("ready", flush=True)
"""


def test_sigterm_saves_the_run_of_a_plain_loop(tmp_path):
    target = tmp_path / "run.npz"
    proc = subprocess.Popen([sys.executable, "-c", LOOP, str(target)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert "SIGTERM" in err and "saving the run" in err
    run = ampviz.Run.load(target)
    assert run.n_steps >= 5 and run.counts[0, :5].sum() > 0


def test_the_sigterm_handler_is_put_back_and_a_users_own_is_left_alone(tmp_path):
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with ampviz.Recorder(model, opt, path=tmp_path / "a.npz"):
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with ampviz.Recorder(model, opt):                                   # no path: nothing to save, no handler
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    def users(signum, frame):
        pass
    signal.signal(signal.SIGTERM, users)
    try:
        with ampviz.Recorder(model, opt, path=tmp_path / "b.npz"):
            assert signal.getsignal(signal.SIGTERM) is users
        assert signal.getsignal(signal.SIGTERM) is users
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# ------------------------------------------------------------------------------------------ item 8
def test_when_the_loop_raises_and_the_save_fails_the_users_exception_stays_first(tmp_path):
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out, other = tmp_path / "runs", tmp_path / "other"
    rec = ampviz.Recorder(model, opt, path=out / "run.npz")
    rec2 = ampviz.Recorder(model, opt, path=other / "run.npz")
    for d in (out, other):
        d.write_text("a file where the directory should be")           # planted: the save cannot happen
    with pytest.raises(KeyError, match="the user's own error") as info:
        with rec:
            train(model, opt, rec, 3)
            raise KeyError("the user's own error")
    notes = getattr(info.value, "__notes__", [])
    assert any("saving the run to" in n and "also failed" in n and "recorder.run.save" in n for n in notes)
    assert not isinstance(info.value.__context__, OSError)
    assert rec.run.n_steps == 3                                           # nothing lost: still in memory
    with pytest.raises(OSError):                                          # no exception of the user's: the save's
        with rec2:
            train(model, opt, rec2, 1)


# ------------------------------------------------------------------------------------------ item 9
@pytest.mark.parametrize("path, message", [
    ("", "path: empty"),
    ("/", "is the file-system root"),
    ("run.txt", "ends in '.txt'; give a file ending in .npz, or a directory"),
    ("/proc/ampviz/run.npz", "cannot write under '/proc/ampviz/run.npz'"),
    (3, "path: expected a str or os.PathLike"),
])
def test_a_save_path_that_could_never_work_fails_at_construction(path, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(".", r"\.")):
        ampviz.Recorder(tiny(), path=path)


def test_a_path_under_a_file_or_a_directory_named_like_a_run_file_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        ampviz.Recorder(tiny(), path=tmp_path / "notes.txt" / "run.npz")
    (tmp_path / "old.npz").mkdir()
    with pytest.raises(ValueError, match="is a directory, but a name ending in .npz"):
        ampviz.Recorder(tiny(), path=tmp_path / "old.npz")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory anyway")
def test_an_unwritable_directory_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="is not writable"):
        ampviz.Recorder(tiny(), path=locked / "run.npz")


def test_an_existing_directory_receives_rank0(tmp_path):
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampviz.Recorder(model, opt, path=tmp_path) as rec:
        train(model, opt, rec, 2)
    assert [p.name for p in tmp_path.iterdir()] == ["rank0.npz"]
    assert ampviz.Run.load(tmp_path).n_steps == 2


def test_a_huge_flush_every_is_bounded_by_max_bytes():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = ampviz.Recorder(model, opt, flush_every=2 ** 20, max_bytes=1 << 20)    # a 2**20-step ring: 5.4 GB
    with rec:
        ring = rec._recording.store.ring                         # the buffer that flush_every sizes
        assert ring.numel() * ring.element_size() <= (1 << 20) // 16
        train(model, opt, rec, 40)
    assert rec.run.n_steps == 40 and rec.run.hist_steps.size == 40


# ----------------------------------------------------------------------------------------- item 11
def test_host_memory_of_a_long_run_stays_within_max_bytes():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    max_bytes = 1 << 20
    row = len(list(model.parameters())) * H.NBINS * 8 + 2 * H.NBINS * 8   # 6 weights + 2 activations
    rec = ampviz.Recorder(model, opt, max_bytes=max_bytes, flush_every=8)
    tracemalloc.start()
    try:
        with pytest.warns(AmpvizWarning, match="max_bytes"):
            with rec:
                train(model, opt, rec, 2)                            # first counts: numba loads its kernels
                base = tracemalloc.get_traced_memory()[0]
                tracemalloc.reset_peak()
                train(model, opt, rec, 600, seed=1)                  # 600 rows: 9.9 MB without decimation
                peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    run = rec.run
    assert run.meta["decimated"] >= 3 and run.hist_steps.size * row <= max_bytes
    assert peak <= 1.1 * max_bytes, f"peak {peak / max_bytes:.2f} x max_bytes"
    assert np.all(run.hist_steps % run.meta["every"] == 0)


def test_snapshots_while_open_are_copies():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampviz.Recorder(model, opt, max_bytes=4 * 8 * H.NBINS * 8, flush_every=1) as rec:
        train(model, opt, rec, 3)
        snap = rec.run
        before = snap.counts.copy()
        with pytest.warns(AmpvizWarning, match="max_bytes"):
            train(model, opt, rec, 6, seed=1)                       # decimates the store in place
    np.testing.assert_array_equal(snap.counts, before)


def test_a_snapshot_taken_mid_step_loses_none_of_that_steps_counts():
    counts = []
    for snapshot in (False, True):
        model = tiny()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(0)
        with ampviz.Recorder(model, opt) as rec:
            for step in range(3):
                x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
                F.cross_entropy(model(x), y).backward()          # activation gradients counted here
                if snapshot and step == 1:
                    assert rec.run.n_steps == 1                   # a live export between backward and step
                opt.step()
                opt.zero_grad()
                rec.step()
        counts.append(rec.run.counts)
    np.testing.assert_array_equal(counts[0], counts[1])


def test_a_snapshot_after_a_step_holds_only_the_later_histograms_and_every_steps_scalars():
    # what live export hands over every export_every steps: copying every histogram each time was quadratic
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampviz.Recorder(model, opt, every=2) as rec:
        train(model, opt, rec, 9)
        full, recent = rec.run, rec.snapshot(after=3)
        assert rec.snapshot().hist_steps.tolist() == full.hist_steps.tolist() == [0, 2, 4, 6, 8]
        with pytest.raises(ValueError, match="after"):
            rec.snapshot(after=-2)
    assert recent.hist_steps.tolist() == [4, 6, 8] and recent.n_steps == full.n_steps == 9
    np.testing.assert_array_equal(recent.counts, full.counts[:, 2:])
    for name in ("loss", "loss_scale", "skipped"):
        np.testing.assert_array_equal(getattr(recent, name), getattr(full, name))
    assert rec.snapshot(after=3).hist_steps.tolist() == [0, 2, 4, 6, 8]       # closed: the whole run

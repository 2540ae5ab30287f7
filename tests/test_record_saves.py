"""A recording reaches the disk before it is needed (issue 23): periodic saves that append only what is new,
a process killed mid-save that leaves the previous save loadable, a second Ctrl-C or SIGTERM (or a
handler raising SystemExit) during a save that waits until the file is complete, temp files of a killed
save removed at the next start, and an existing directory with a dot in its name taken as a directory."""

import os
import signal
import subprocess
import sys
import warnings
import zipfile

import numpy as np
import pytest
import torch
from test_record_files import tiny
from test_record_files import train as steps  # the same 8-sample loop, scheduler optional

import ampviz
from ampviz._files import TMP_SUFFIX
from ampviz._warnings import AmpvizWarning


def same_run(a: ampviz.Run, b: ampviz.Run) -> None:
    for name in ("steps", "loss", "loss_scale", "next_scale", "skipped", "hist_steps", "counts", "grad_order",
                 "scheduler_steps"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert a.tensor_names == b.tensor_names and a.meta["every"] == b.meta["every"]


def test_periodic_saves_append_what_is_new_and_load_as_the_run(tmp_path):
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    target = tmp_path / "run.npz"
    rec = ampviz.Recorder(model, opt, scheduler=sched, path=target, save_every=None, save_every_steps=5)
    seen = []
    with rec:
        steps(model, opt, rec, 4, sched)
        assert not target.exists() and rec.saved is None            # no save before the first interval
        for k in range(1, 5):
            steps(model, opt, rec, 5, sched, seed=k)
            data, inode = target.read_bytes(), target.stat().st_ino
            seen.append((data, inode))
            on_disk = ampviz.Run.load(target)
            assert on_disk.n_steps == rec.saved[1] == 4 + 5 * k - (4 + 5 * k) % 5
            same_run(on_disk, _prefix(rec.run, on_disk.n_steps))
    run = rec.run
    assert rec.saved == (target, 24)
    same_run(ampviz.Run.load(target), run)
    # each save after the first added bytes after the previous ones: nothing written before was rewritten
    for (before, inode_before), (after, inode_after) in zip(seen, seen[1:]):
        assert inode_after == inode_before and after[:len(before)] == before
    with zipfile.ZipFile(target) as z:
        names = z.namelist()
    assert {"counts.npy", "counts.1.npy", "counts.4.npy"} <= set(names) and names.count("meta.npy") == 1


def _prefix(run: ampviz.Run, n: int) -> ampviz.Run:
    """The first ``n`` steps of a one-rank run."""
    from dataclasses import replace
    h = int(np.searchsorted(run.hist_steps, n))
    return replace(run, steps=run.steps[:n], loss=run.loss[:, :n], loss_scale=run.loss_scale[:, :n],
                   next_scale=run.next_scale[:, :n], skipped=run.skipped[:, :n], hist_steps=run.hist_steps[:h],
                   counts=run.counts[:, :h], grad_order=run.grad_order[:, :h],
                   scheduler_steps=run.scheduler_steps[:, :n])


def test_decimation_and_many_parts_rewrite_the_file_whole(tmp_path):
    from ampviz import histogram as H
    from ampviz.run._write import MAX_PARTS
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    target = tmp_path / "run.npz"
    row = 8 * (H.NBINS * 8 + 4) + 8                               # 6 weights + 2 activations
    rec = ampviz.Recorder(model, opt, path=target, save_every=None, save_every_steps=1, max_bytes=40 * row,
                          flush_every=1)
    with pytest.warns(AmpvizWarning, match="max_bytes"), rec:
        steps(model, opt, rec, MAX_PARTS + 30)
    run = rec.run
    assert run.meta["decimated"] >= 1
    same_run(ampviz.Run.load(target), run)
    with zipfile.ZipFile(target) as z:
        parts = [n for n in z.namelist() if n.startswith("counts.")]
    assert len(parts) < MAX_PARTS


def test_a_failing_periodic_save_warns_and_training_goes_on(tmp_path):
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    target = tmp_path / "rank0.npz"
    with ampviz.Recorder(model, opt, path=tmp_path, save_every_steps=2) as rec:
        steps(model, opt, rec, 2)
        target.unlink()
        target.mkdir()                                            # the file cannot be written any more
        with pytest.warns(AmpvizWarning, match=r"saving the run to .*rank0.npz failed \(IsADirectoryError.*recording "
                                               r"goes on, the next save tries again \(the file holds 2 steps\)"):
            steps(model, opt, rec, 4)                             # two failed saves, one warning
        target.rmdir()
        steps(model, opt, rec, 2)
        assert rec.saved[1] == 8
    assert ampviz.Run.load(target).n_steps == 8


def test_saves_by_time(tmp_path):
    import time
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = ampviz.Recorder(model, opt, path=tmp_path, save_every=1.0)
    with rec:
        steps(model, opt, rec, 2)
        assert rec.saved is None
        time.sleep(1.1)
        steps(model, opt, rec, 1)
        assert rec.saved == (tmp_path / "rank0.npz", 3)
        steps(model, opt, rec, 1)                                   # well within a second: no save
        assert rec.saved[1] == 3
    assert rec.saved[1] == 4


@pytest.mark.parametrize("value, message", [(0, "save_every: expected a positive number of seconds or None"),
                                            (float("nan"), "save_every: expected a positive number"),
                                            ("60", "save_every: expected a positive number")])
def test_save_every_is_checked(value, message):
    with pytest.raises(ValueError, match=message):
        ampviz.Recorder(tiny(), save_every=value)
    with pytest.raises(ValueError, match="save_every_steps: expected an integer >= 1, got 0"):
        ampviz.Recorder(tiny(), save_every_steps=0)


# ----------------------------------------------------------------------------- killed, interrupted
LOOP = """
import os, signal, sys, time, torch, torch.nn as nn, torch.nn.functional as F
import ampviz
mode, path = sys.argv[1], sys.argv[2]
{setup}
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
every = {{"save_every_steps": int(sys.argv[3])}} if sys.argv[3] != "0" else {{}}
with ampviz.Recorder(model, opt, path=path, **every) as rec:
    step = 0
    while True:
        F.cross_entropy(model(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
        opt.step(); opt.zero_grad(); rec.step()
        step += 1
        if step == 12:
            print("ready", flush=True)
"""

# the first os.fsync of a save (every save ends in one, before the rename or after the append) sends a signal
SIGNAL_IN_SAVE = """
real_fsync, sent = os.fsync, []
def fsync(fd):
    if armed and not sent:
        sent.append(1)
        os.kill(os.getpid(), {signum})      # a second Ctrl-C / SIGTERM, while the file is being written
        time.sleep(0.3)
    return real_fsync(fd)
os.fsync = fsync
armed = False
def first(signum, frame):
    global armed
    armed = True
    {first}
{install}
"""


def run_loop(tmp_path, setup: str, every: int = 0, signum=None) -> subprocess.CompletedProcess:
    """The loop above in a subprocess, saving every ``every`` steps (0: the default, every 60 s), with
    ``setup`` run first; ``signum`` is sent once it has run 12 steps."""
    target = tmp_path / "run.npz"
    proc = subprocess.Popen([sys.executable, "-c", LOOP.format(setup=setup), "x", str(target), str(every)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if signum is not None:
            assert proc.stdout.readline().strip() == "ready"
            proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("first_signal, handler", [
    (signal.SIGINT, "raise KeyboardInterrupt"),                    # Ctrl-C, then Ctrl-C again
    (signal.SIGTERM, None),                                         # SIGTERM (ampviz's handler), then SIGTERM
    (signal.SIGTERM, "raise SystemExit(143)"),                      # the user's handler raises SystemExit, twice
])
def test_a_second_signal_during_the_save_still_leaves_the_run_on_disk(tmp_path, first_signal, handler):
    setup = SIGNAL_IN_SAVE.format(
        signum=int(first_signal), first=handler or "_exit_on_term(signum, frame)",
        install=(f"signal.signal({int(first_signal)}, first)" if handler else
                 "from ampviz.record._signals import _exit_on_term\n"
                 "import ampviz.record._signals as guard\nguard._exit_on_term = first"))
    done = run_loop(tmp_path, setup, signum=first_signal)
    assert "received while saving the run" in done.stderr, done.stderr[-2000:]
    run = ampviz.Run.load(tmp_path / "run.npz")
    assert run.n_steps >= 12 and run.counts[0].sum() > 0
    assert not list(tmp_path.glob(f"*{TMP_SUFFIX}"))


KILL_IN_APPEND = """
import ampviz.run._write as w
real, calls = w._write_directory, []
def killed(out, entries):
    calls.append(1)
    if len(calls) == 3:                      # the third save: its parts are written, its directory is not
        out.write(b"PK\\x01\\x02" + bytes(40))
        out.f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return real(out, entries)
w._write_directory = killed
"""


def test_sigkill_mid_append_leaves_the_previous_save_loadable(tmp_path):
    done = run_loop(tmp_path, KILL_IN_APPEND, every=4)
    assert done.returncode == -signal.SIGKILL
    with pytest.warns(AmpvizWarning, match=r"run.npz: its last save did not finish \(.* at its end left out\)"):
        run = ampviz.Run.load(tmp_path / "run.npz")
    assert run.n_steps == 8                                         # the two saves that completed
    from ampviz.cli import main
    with pytest.warns(AmpvizWarning, match="its last save did not finish"):
        assert main(["info", str(tmp_path / "run.npz")]) == 0


KILL_IN_WHOLE_WRITE = """
os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)    # the save on SIGTERM dies before its rename
"""


def test_a_temp_file_left_by_a_killed_save_goes_at_the_next_start(tmp_path):
    done = run_loop(tmp_path, KILL_IN_WHOLE_WRITE, signum=signal.SIGTERM)
    assert done.returncode == -signal.SIGKILL
    left = list(tmp_path.glob(f".run.npz.*{TMP_SUFFIX}"))
    assert len(left) == 1 and not (tmp_path / "run.npz").exists()
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampviz.Recorder(model, opt, path=tmp_path / "run.npz"):
        assert not list(tmp_path.glob(f"*{TMP_SUFFIX}"))            # its writer is gone: removed at once
    ampviz.Recorder(model, opt, path=tmp_path / "other.npz")      # another file's start leaves others alone


def test_a_temp_file_of_a_writer_at_work_is_left_alone(tmp_path):
    import threading

    from ampviz._files import atomic_write, clean_stale
    writing, release = threading.Event(), threading.Event()

    def slow(f):
        f.write(b"x")
        writing.set()
        release.wait(30)
    worker = threading.Thread(target=atomic_write, args=(tmp_path / "a.npz", slow))
    worker.start()
    try:
        assert writing.wait(30)
        clean_stale(tmp_path / "a.npz")
        assert len(list(tmp_path.glob(f"*{TMP_SUFFIX}"))) == 1       # locked by its writer: kept
    finally:
        release.set()
        worker.join()
    assert [p.name for p in tmp_path.iterdir()] == ["a.npz"]


def test_system_exit_with_a_failing_save_prints_what_was_lost(tmp_path, capsys):
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = tmp_path / "runs"
    rec = ampviz.Recorder(model, opt, path=out / "run.npz")
    out.write_text("a file where the directory should be")          # the save cannot happen
    with pytest.raises(SystemExit):
        with rec:
            steps(model, opt, rec, 3)
            raise SystemExit(143)                                   # as a SIGTERM handler does
    err = capsys.readouterr().err
    assert "ampviz: saving the run to" in err and "also failed" in err and "recorder.run.save" in err
    assert rec.run.n_steps == 3


# ----------------------------------------------------------------------------- a dot in a directory name
def test_an_existing_directory_with_a_dot_in_its_name_is_a_directory(tmp_path):
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for name in ("lr3e-4.bs64", "tmp.XXXX"):
        d = tmp_path / name
        d.mkdir()
        with ampviz.Recorder(model, opt, path=d) as rec:
            steps(model, opt, rec, 2)
        assert [p.name for p in d.iterdir()] == ["rank0.npz"] and ampviz.Run.load(d).n_steps == 2
        assert rec.run.save(d) == [d / "rank0.npz"]                  # Run.save: the same rule
    with pytest.raises(ValueError, match=r"ends in '\.bs32'; .* \(an existing one, or a new name without a dot"):
        ampviz.Recorder(model, opt, path=tmp_path / "lr3e-4.bs32")   # not there: a typo of a file name?
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rec.run.save(tmp_path / "run.v2") == [tmp_path / "run.v2.npz"]     # appended, not replaced


def test_file_descriptors_and_handlers_are_left_as_they_were(tmp_path):
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    fds = len(os.listdir("/proc/self/fd"))
    with ampviz.Recorder(model, opt, path=tmp_path, save_every_steps=1) as rec:
        steps(model, opt, rec, 5)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    assert len(os.listdir("/proc/self/fd")) == fds

"""Nothing lost, nothing injected (issue 23): ``ampviz report -o`` never replaces a run, a link or a device;
every text output escapes control and bidi characters from files; names that are not UTF-8 and bad
arguments give one clear line; SIGTERM during a report leaves no temp file; a load across ranks and
arguments stays within one memory budget, without a second copy of the histograms."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ampviz
from ampviz import histogram as H
from ampviz.cli import main


def small_run(tensors=3, steps=5, rank=0, world=1) -> ampviz.Run:
    """One rank, ``tensors`` weight gradients; tensor t loses (t % 7) / 10 of its values to fp16 at scale 1."""
    counts = np.zeros((1, steps, tensors, H.NBINS), dtype=np.int64)
    for t in range(tensors):
        counts[0, :, t, H.column(-10)] = 100 - 10 * (t % 7)
        counts[0, :, t, H.column(-40)] = 10 * (t % 7)
    one = np.ones((1, steps))
    return ampviz.Run(np.arange(steps), one, one, one, one < 0, np.arange(steps), counts,
                      [f"layer{t}.weight" for t in range(tensors)], ["weight"] * tensors, ["torch.float32"] * tensors,
                      {"ranks": [rank], "world_size": world, "every": 1})


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ampviz: error:") and "Traceback" not in err, err
    return lines[0]


def ampviz_cli(*args, env=None, **kw) -> subprocess.CompletedProcess:
    """``python -m ampviz ARGS`` with strict UTF-8 output (as on a UTF-8 terminal), args as str or bytes."""
    env = dict(os.environ, PYTHONIOENCODING="utf-8", LC_ALL="C.UTF-8", **(env or {}))
    return subprocess.run([sys.executable, "-m", "ampviz", *args], capture_output=True, env=env, timeout=180, **kw)


# ---------------------------------------------------------------------------------- 1: report -o onto a run
def test_report_never_replaces_a_run(tmp_path, capsys):
    run_file = small_run().save(tmp_path / "run.npz")[0]
    before = run_file.read_bytes()
    ranks = tmp_path / "ddp"
    ampviz.Run.merge([small_run(rank=0, world=2), small_run(rank=1, world=2)]).save(ranks)
    disguised = tmp_path / "copy.html"
    disguised.write_bytes(before)                              # a run under another name
    link = tmp_path / "link.html"
    link.symlink_to(run_file)
    for output, message in ((run_file, "holds an ampviz run"), (ranks / "rank1.npz", "holds an ampviz run"),
                            (ranks / "rank2.npz", "ends in .npz"), (disguised, "holds an ampviz run"),
                            (link, "holds an ampviz run")):
        assert main(["report", str(run_file), str(ranks), "-o", str(output)]) == 1
        assert message in one_error_line(capsys)
    assert run_file.read_bytes() == before and disguised.read_bytes() == before and link.is_symlink()
    assert ampviz.Run.load(ranks).ranks == [0, 1] and not (ranks / "rank2.npz").exists()
    assert main(["report", str(ranks), "-o", str(ranks / "report.html")]) == 0    # beside the ranks: fine
    assert ampviz.Run.load(ranks).ranks == [0, 1]


# ------------------------------------------------------------------------------- 5: escaped text outputs
def hostile_names(tmp_path) -> Path:
    run = small_run()
    run.tensor_names[1] = "fc\x1b]0;owned\x07\x1b[2J"
    run.tensor_names[2] = "\u202eweight.fc"                    # right-to-left override: reads backwards
    return run.save(tmp_path / "names.npz")[0]


def test_doctor_info_and_report_escape_control_and_bidi_characters(tmp_path):
    path = hostile_names(tmp_path)
    for args in (["doctor", str(path)], ["info", str(path)],
                 ["report", str(path), "-o", str(tmp_path / "r.html"), "--title", "t\x1b[2J\u202e"]):
        done = ampviz_cli(*args)
        assert done.returncode == 0, done.stderr
        out = done.stdout.decode()
        for raw in ("\x1b", "\x07", "\u202e"):
            assert raw not in out, (args[0], out)
    doctor = ampviz_cli("doctor", str(path)).stdout.decode()
    assert "fc\\x1b]0;owned\\x07\\x1b[2J" in doctor and "\\u202eweight.fc" in doctor
    page = (tmp_path / "r.html").read_text()
    assert "<title>t\\x1b[2J\\u202e</title>" in page and "\u202e" not in page.split("<script")[0]


def test_a_file_name_that_is_not_utf8_is_shown_escaped(tmp_path):
    name = os.fsdecode(b"run-\xff.npz")                         # '\udcff': a lone surrogate in Python
    path = small_run().save(tmp_path / name)[0]
    out = tmp_path / os.fsdecode(b"report-\xfe.html")
    for args in (["info", path], ["doctor", path], ["report", path, "-o", out]):
        done = ampviz_cli(*[os.fsencode(a) for a in args])
        assert done.returncode == 0, done.stderr
        assert b"\\udcff" in done.stdout or args[0] == "report", done.stdout
    assert out.exists() and "run-\\udcff.npz" in out.read_text()
    missing = ampviz_cli("info", os.fsencode(tmp_path / os.fsdecode(b"gone-\xff.npz")))
    assert missing.returncode == 1 and missing.stderr.decode().endswith("gone-\\udcff.npz: no such file or directory\n")


def test_a_title_that_is_not_utf8_is_one_line_naming_the_title(tmp_path):
    path = small_run().save(tmp_path / "run.npz")[0]
    done = ampviz_cli("report", str(path), "-o", str(tmp_path / "r.html"), "--title", b"caf\xe9")
    err = done.stderr.decode()
    assert done.returncode == 1 and err.count("\n") == 1, err
    assert err.startswith("ampviz: error: title: 'caf\\udce9' holds \\udce9, a byte that is not UTF-8 text")
    assert not (tmp_path / "r.html").exists()


# ------------------------------------------------------------------------------------- 6: links, devices
def test_output_through_a_dangling_link_writes_where_it_points(tmp_path, capsys):
    path = small_run().save(tmp_path / "run.npz")[0]
    link = tmp_path / "latest.html"
    link.symlink_to(tmp_path / "reports" / "today.html")         # dangling: reports/ does not exist yet
    assert main(["report", str(path), "-o", str(link)]) == 0
    assert link.is_symlink() and (tmp_path / "reports" / "today.html").read_text().startswith("<!DOCTYPE html>")


def test_output_through_a_link_to_dev_stdout_writes_to_stdout(tmp_path):
    path = small_run().save(tmp_path / "run.npz")[0]
    link = tmp_path / "out.html"
    link.symlink_to("/dev/stdout")
    done = ampviz_cli("report", str(path), "-o", str(link))
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and os.readlink(link) == "/dev/stdout"
    assert done.stdout.startswith(b"<!DOCTYPE html>") and done.stdout.endswith(b"</html>")
    assert done.stderr.decode() == f"wrote {link} (1 run)\n"
    assert not list(tmp_path.glob(".*ampviz-tmp"))


# -------------------------------------------------------------------------------------- 10: arguments
@pytest.mark.parametrize("argv, message", [
    (["info", ""], "argument RUN: empty path ''"),
    (["doctor", " "], "argument RUN: empty path ' '"),
    (["report", "x.npz", "-o", ""], "argument -o/--output: empty path ''"),
    (["export", "x.npz", "--tensorboard", ""], "argument --tensorboard: empty path ''"),
    (["demo", "-o", "d", "--seed", str(2 ** 64)], "--seed: expected an integer from 0 to 4294967295 (2**32 - 1), "
                                                  "got '18446744073709551616'"),
    (["demo", "-o", "d", "--seed", "-1"], "--seed: expected an integer from 0 to 4294967295"),
])
def test_arguments_that_mean_something_else_are_one_line_usage_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in one_error_line(capsys)


def test_json_output_refuses_a_run_given_twice(tmp_path, capsys):
    path = small_run().save(tmp_path / "run.npz")[0]
    for command in ("info", "doctor"):
        assert main([command, str(path), str(tmp_path / "." / "run.npz"), "--json"]) == 1
        assert "is given twice; with --json each run is printed under its path" in one_error_line(capsys)
    assert main(["info", str(path), str(path)]) == 0               # as text: both shown, nothing lost


def test_export_to_wandb_without_a_login_says_how_to_log_in(tmp_path):
    pytest.importorskip("wandb")
    path = small_run().save(tmp_path / "run.npz")[0]
    env = {"HOME": str(tmp_path), "WANDB_DIR": str(tmp_path), "WANDB_API_KEY": "", "WANDB_MODE": "",
           "WANDB_SILENT": "true", "NETRC": str(tmp_path / "netrc")}
    done = ampviz_cli("export", str(path), "--wandb", "--quiet", env=env)
    err = done.stderr.decode().strip().splitlines()
    assert done.returncode == 1 and len(err) == 1, done.stderr
    assert err[0].startswith("ampviz: error: W&B could not start a run") and "internal error" not in err[0]
    assert "wandb login" in err[0] and "WANDB_MODE=offline" in err[0]


# ------------------------------------------------------------------------- 4: SIGTERM during a report
REPORT_KILLED = """
import os, signal, sys, time
import ampviz.report
from ampviz import _files
from ampviz.cli import main

real = _files.atomic_write
def slow(target, write, **kw):                  # SIGTERM arrives while the page is being written
    def write_then_wait(f):
        write(f)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    return real(target, write_then_wait, **kw)
ampviz.report.atomic_write = slow
sys.exit(main(["report", sys.argv[1], "-o", sys.argv[2]]))
"""


def test_sigterm_during_a_report_leaves_no_temp_file(tmp_path):
    path = small_run().save(tmp_path / "run.npz")[0]
    out = tmp_path / "out" / "r.html"
    done = subprocess.run([sys.executable, "-c", REPORT_KILLED, str(path), str(out)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stderr.strip() == "ampviz: error: terminated (SIGTERM); nothing half-written is left behind"
    assert list(out.parent.iterdir()) == []


# ------------------------------------------------------------------------------------- 11: memory
MEASURE = """
import json, sys, tracemalloc, warnings
import numpy as np
from ampviz.cli import main
from ampviz.run import Run
tracemalloc.start()
if sys.argv[1] == "load":
    run = Run.load(sys.argv[2])
    out = {"shape": list(run.counts.shape)}
else:
    out = {"status": main(sys.argv[1:])}
out["peak"] = tracemalloc.get_traced_memory()[1]
print(json.dumps(out), file=sys.stderr)
"""


def measured(*args, env=None) -> dict:
    done = subprocess.run([sys.executable, "-c", MEASURE, *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, **(env or {})))
    return done, json.loads(done.stderr.strip().splitlines()[-1])


RANKS, STEPS, TENSORS = 6, 100, 10                 # one rank's counts: 100 x 10 x 257 int64 = 2.06 MB
RANK_BYTES = STEPS * TENSORS * H.NBINS * 8


@pytest.fixture(scope="module")
def ranks_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    for r in range(RANKS):
        run = small_run(TENSORS, STEPS, rank=r, world=RANKS)
        run.counts[0, :, :, H.column(-r - 1)] = np.arange(STEPS)[:, None] + r      # rank and step show
        run.save(out / f"rank{r}.npz")
    return out


def test_loading_ranks_holds_the_merged_histograms_once(ranks_dir):
    done, out = measured("load", ranks_dir)
    assert out["shape"] == [RANKS, STEPS, TENSORS, H.NBINS], done.stderr
    merged = RANKS * RANK_BYTES
    assert out["peak"] < 1.25 * merged, f"peak {out['peak'] / merged:.2f} x the merged counts"
    run = ampviz.Run.load(ranks_dir)                               # each rank in its own slice
    for r in range(RANKS):
        np.testing.assert_array_equal(run.counts[r, :, 0, H.column(-r - 1)], np.arange(STEPS) + r)


def test_the_budget_holds_across_ranks_and_report_arguments(ranks_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AMPVIZ_MAX_RUN_BYTES", str(int(2.5 * RANK_BYTES)))     # 2.5 ranks' worth
    assert main(["info", str(ranks_dir / "rank0.npz"), str(ranks_dir / "rank1.npz")]) == 0   # one at a time
    capsys.readouterr()
    assert main(["info", str(ranks_dir)]) == 1
    line = one_error_line(capsys)
    assert line.startswith(f"ampviz: error: {ranks_dir}: corrupt or oversized run: counts (6 x 100 x 10 x 257 "
                           f"int64) would inflate to 12.3 MB, beyond the 5.1 MB ampviz reads at once"), line
    args = ["report", *(str(ranks_dir / f"rank{r}.npz") for r in range(3)), "-o", str(tmp_path / "r.html")]
    assert main(args) == 1                                                    # three runs: 3 ranks' worth
    assert "rank2.npz: corrupt or oversized run: counts would inflate to 2.1 MB" in one_error_line(capsys)
    assert not (tmp_path / "r.html").exists()


def test_info_summarises_file_by_file(ranks_dir):
    files = sorted(ranks_dir.glob("*.npz"))
    done, one = measured("info", files[0])
    done, all_ = measured("info", *files)
    assert one["status"] == all_["status"] == 0, done.stderr
    assert all_["peak"] < one["peak"] + RANK_BYTES, f"{all_['peak'] / one['peak']:.2f} x one file's peak"

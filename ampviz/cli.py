"""The ``ampviz`` command (also ``python -m ampviz``): summarise runs, write reports, run a demo.

Usage::

    ampviz info RUN [RUN ...] [--format fp16] [--json]
    ampviz doctor RUN [RUN ...] [--json]
    ampviz report RUN [RUN ...] -o report.html [--format fp16] [--title TEXT]
    ampviz demo -o DIR [--steps 600] [--device auto|cpu|cuda] [--seed 0] [--quiet]
    ampviz export RUN [--tensorboard DIR] [--wandb [--wandb-project NAME]] [--domain recorded] [--quiet]

``RUN`` is a run file (``.npz``) or a directory of per-rank run files (one DDP run). Errors
(a missing or foreign file, a bad argument) print one line starting with ``ampviz: error:`` on
stderr and exit with a non-zero status, without a traceback. ``ampviz doctor`` also exits with
status 1 when a run has a finding of severity "error", so a CI job can fail on it::

    $ ampviz demo -o runs/demo --steps 200
    $ ampviz info runs/demo/run.npz
    $ ampviz report runs/demo/run.npz -o report.html
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

from . import __version__
from ._extras import MissingExtra, Unavailable, require
from ._text import printable
from .formats import FORMATS
from .run import Budget, Run, RunFileError, strict_json

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line: ``ampviz: error: ...``."""

    def error(self, message):
        self.exit(2, f"ampviz: error: {message} (see '{self.prog} --help')\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


_SEED_MAX = 2 ** 32 - 1


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= _SEED_MAX:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to {_SEED_MAX} (2**32 - 1), got "
                                         f"{printable(text)!r}")
    return value


def _path(text: str) -> str:
    """A path argument: an empty one would mean the current directory, never what was meant."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"empty path {text!r}; give a file or directory")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``ampviz`` command."""
    p = _Parser(prog="ampviz", description="See what mixed precision does to your gradients.")
    p.add_argument("--version", action="version", version=f"ampviz {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{info,doctor,report,demo,export}")
    fmt = dict(choices=list(FORMATS), default="fp16", help="format the fractions refer to (default fp16)")

    info = sub.add_parser("info", help="print a concise summary of runs")
    info.add_argument("runs", nargs="+", type=_path, metavar="RUN", help="run file (.npz) or directory of rank files")
    info.add_argument("--format", **fmt)
    info.add_argument("--json", action="store_true", help="print Run.summary() as JSON instead")
    info.set_defaults(func=_cmd_info)

    doctor = sub.add_parser("doctor", help="findings: what went wrong in runs, the evidence, what to do")
    doctor.add_argument("runs", nargs="+", type=_path, metavar="RUN",
                        help="run file (.npz) or directory of rank files")
    doctor.add_argument("--json", action="store_true", help="print Run.diagnose() as strict JSON instead")
    doctor.set_defaults(func=_cmd_doctor)

    report = sub.add_parser("report", help="write a self-contained HTML report")
    report.add_argument("runs", nargs="+", type=_path, metavar="RUN",
                        help="run file (.npz) or directory of rank files")
    report.add_argument("-o", "--output", required=True, type=_path,
                        help="the HTML file to write (never a file holding a run)")
    report.add_argument("--format", **fmt)
    report.add_argument("--title", default="ampviz report", help="page title")
    report.set_defaults(func=_cmd_report)

    demo = sub.add_parser("demo", help="record a short real fp16 training run, with and without a GradScaler, "
                                        "and write their report")
    demo.add_argument("-o", "--output", required=True, type=_path,
                      help="directory for run.npz, no_scaling.npz and report.html")
    demo.add_argument("--steps", type=_positive_int, default=600,
                      help="optimizer steps (default 600: enough to learn the digits with a GradScaler)")
    demo.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: auto")
    demo.add_argument("--seed", type=_seed, default=0, help="seed of the model and batch order (0 to 2**32 - 1)")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.set_defaults(func=_cmd_demo)

    export = sub.add_parser("export", help="write a run to TensorBoard event files and/or a W&B run")
    export.add_argument("run", metavar="RUN", type=_path, help="run file (.npz) or directory of rank files")
    export.add_argument("--tensorboard", type=_path, metavar="DIR", help="log directory to write event files to")
    export.add_argument("--wandb", action="store_true", help="log to a new W&B run (WANDB_MODE=offline works)")
    export.add_argument("--wandb-project", default="ampviz", metavar="NAME", help="W&B project (default ampviz)")
    export.add_argument("--domain", choices=["recorded", "unscaled", "scaled"], default="recorded",
                        help="counts as recorded (default), or all unscaled / all scaled")
    export.add_argument("--quiet", action="store_true", help="no progress bar")
    export.set_defaults(func=_cmd_export)
    return p


def main(argv=None) -> int:
    """Run the ``ampviz`` command with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:            # --help, --version, or a usage error already printed
        return e.code if isinstance(e.code, int) else 2
    try:
        with _term_exits():
            status = args.func(args)
        sys.stdout.flush()             # a reader that went away (ampviz info RUN | head -1) shows up here
        return status
    except BrokenPipeError:
        return _stdout_gone()
    except (RunFileError, ValueError, OSError, MissingExtra, Unavailable) as e:
        return _fail(str(e) or type(e).__name__)
    except KeyboardInterrupt:
        return _fail("interrupted", status=130)
    except _Terminated:
        return _fail("terminated (SIGTERM); nothing half-written is left behind", status=128 + signal.SIGTERM)
    except Exception as e:             # a bug, not the user's doing: still one line (AMPVIZ_DEBUG=1: the traceback)
        if os.environ.get("AMPVIZ_DEBUG"):
            raise
        return _fail(f"internal error ({type(e).__name__}: {e}); please report it with the command line and the "
                     "run file (AMPVIZ_DEBUG=1 shows the traceback)")


def _fail(message: str, status: int = 1) -> int:
    print(f"ampviz: error: {printable(' '.join(message.split()))}", file=sys.stderr)
    return status


def _stdout_gone() -> int:
    """The reader of stdout closed it: stop quietly, like any Unix tool whose pipe closed (status 128 + SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())      # the interpreter's last flush then has nowhere to fail
    except (OSError, ValueError):
        pass
    return 141


class _Terminated(BaseException):
    """SIGTERM arrived: unwind like Ctrl-C, so that a file being written is removed, not left half-written."""


def _raise_terminated(signum, frame):
    raise _Terminated


class _term_exits:
    """While a command runs (main thread, default SIGTERM action only), SIGTERM raises _Terminated."""

    def __enter__(self):
        self.installed = (threading.current_thread() is threading.main_thread()
                          and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
        if self.installed:
            signal.signal(signal.SIGTERM, _raise_terminated)

    def __exit__(self, *exc):
        if self.installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return False


def _load(path, budget: Budget | None = None) -> Run:
    from .run import load
    return load(Path(path), budget)


def _distinct(args, option: str) -> None:
    """Refuse a RUN given twice where the output is keyed by path (JSON): one of the two would vanish."""
    seen = set()
    for path in args.runs:
        key = os.path.normpath(path)
        if key in seen:
            raise ValueError(f"RUN: {path!r} is given twice; with {option} each run is printed under its path, so "
                             "one would be lost")
        seen.add(key)


def _cmd_info(args) -> int:
    from .report import summary_rows
    if args.json:
        _distinct(args, "--json")
    summaries, failed, shown = {}, 0, 0
    for path in args.runs:             # like ls or wc: one error line per unreadable run, the others summarised
        try:
            run = _load(path)              # one at a time: only one run is held in memory
        except RunFileError as e:
            failed = _fail(str(e))
            continue
        if args.json:                      # strict JSON: no NaN or Infinity tokens (non-finite numbers are null)
            summaries[str(path)] = strict_json(run.summary(args.format))
            continue
        rows = summary_rows(run, args.format)
        width = max(len(label) for label, _ in rows)
        print(("\n" if shown else "") + printable(path))
        for label, text in rows:
            print(f"  {label:<{width}}  {printable(text)}")
        shown += 1
        del run
    if args.json and summaries:
        out = summaries if len(args.runs) > 1 else next(iter(summaries.values()))
        print(json.dumps(out, indent=2, allow_nan=False))
    return failed


def _cmd_doctor(args) -> int:
    """Exit status 1 when a run has a finding of severity "error" (CI can fail on it), else 0."""
    from .doctor import as_text
    if args.json:
        _distinct(args, "--json")
    runs = [(str(path), _load(path).diagnose()) for path in args.runs]   # one run at a time; fail before printing
    errors = any(f["severity"] == "error" for _, d in runs for f in d["findings"])
    if args.json:
        out = dict(runs)
        print(json.dumps(out if len(runs) > 1 else runs[0][1], indent=2, allow_nan=False))
        return int(errors)
    print("\n\n".join(as_text(diagnosis, path) for path, diagnosis in runs))
    return int(errors)


def _cmd_report(args) -> int:
    require("plotly", "ampviz report")
    from .report import check_output, write_report
    output = check_output(args.output, "-o/--output")    # before anything is loaded
    budget = Budget()                                     # every run of the report, together
    runs = [_load(path, budget) for path in args.runs]
    write_report(runs, output, labels=list(args.runs), format=args.format, title=args.title)
    runs_text = f"{len(runs)} run{'s' if len(runs) != 1 else ''}"
    if output.is_file():
        print(f"wrote {printable(output)} ({output.stat().st_size / 1e6:.1f} MB, {runs_text})")
    else:                                                 # a device or a pipe (-o /dev/stdout): not into the page
        print(f"wrote {printable(output)} ({runs_text})", file=sys.stderr)
    return 0


def _cmd_demo(args) -> int:
    for module in ("sklearn", "tqdm", "plotly"):          # its data, its progress bar, its report
        require(module, "ampviz demo")
    from .demo import write_demo
    for line in write_demo(args.output, steps=args.steps, device=args.device, seed=args.seed,
                           progress=not args.quiet):
        print(printable(line))
    return 0


def _cmd_export(args) -> int:
    if args.tensorboard is None and not args.wandb:
        return _fail("export: give --tensorboard DIR, --wandb, or both", status=2)
    from .export import to_tensorboard, to_wandb
    run = _load(args.run)
    if args.tensorboard is not None:
        dirs = to_tensorboard(run, args.tensorboard, domain=args.domain, progress=not args.quiet)
        where = ", ".join(str(d) for d in dirs)
        print(printable(f"wrote {run.n_steps} steps to {where} (view: tensorboard --logdir {args.tensorboard})"))
    if args.wandb:
        target = to_wandb(run, domain=args.domain, project=args.wandb_project, progress=not args.quiet)
        print(printable(f"logged {run.n_steps} steps to W&B run {target.name or target.id} in project "
                        f"{args.wandb_project}"))
    return 0

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
import sys
from pathlib import Path

from . import __version__
from ._extras import MissingExtra, require
from ._runfile import strict_json
from .formats import FORMATS
from .run import Run, RunFileError

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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``ampviz`` command."""
    p = _Parser(prog="ampviz", description="See what mixed precision does to your gradients.")
    p.add_argument("--version", action="version", version=f"ampviz {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{info,doctor,report,demo,export}")
    fmt = dict(choices=list(FORMATS), default="fp16", help="format the fractions refer to (default fp16)")

    info = sub.add_parser("info", help="print a concise summary of runs")
    info.add_argument("runs", nargs="+", metavar="RUN", help="run file (.npz) or directory of rank files")
    info.add_argument("--format", **fmt)
    info.add_argument("--json", action="store_true", help="print Run.summary() as JSON instead")
    info.set_defaults(func=_cmd_info)

    doctor = sub.add_parser("doctor", help="findings: what went wrong in runs, the evidence, what to do")
    doctor.add_argument("runs", nargs="+", metavar="RUN", help="run file (.npz) or directory of rank files")
    doctor.add_argument("--json", action="store_true", help="print Run.diagnose() as strict JSON instead")
    doctor.set_defaults(func=_cmd_doctor)

    report = sub.add_parser("report", help="write a self-contained HTML report")
    report.add_argument("runs", nargs="+", metavar="RUN", help="run file (.npz) or directory of rank files")
    report.add_argument("-o", "--output", required=True, type=Path, help="the HTML file to write")
    report.add_argument("--format", **fmt)
    report.add_argument("--title", default="ampviz report", help="page title")
    report.set_defaults(func=_cmd_report)

    demo = sub.add_parser("demo", help="record a short real fp16 training run, with and without a GradScaler, "
                                        "and write their report")
    demo.add_argument("-o", "--output", required=True, type=Path,
                      help="directory for run.npz, no_scaling.npz and report.html")
    demo.add_argument("--steps", type=_positive_int, default=600,
                      help="optimizer steps (default 600: enough to learn the digits with a GradScaler)")
    demo.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: auto")
    demo.add_argument("--seed", type=int, default=0, help="seed of the model and batch order")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.set_defaults(func=_cmd_demo)

    export = sub.add_parser("export", help="write a run to TensorBoard event files and/or a W&B run")
    export.add_argument("run", metavar="RUN", help="run file (.npz) or directory of rank files")
    export.add_argument("--tensorboard", type=Path, metavar="DIR", help="log directory to write event files to")
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
        status = args.func(args)
        sys.stdout.flush()             # a reader that went away (ampviz info RUN | head -1) shows up here
        return status
    except BrokenPipeError:
        return _stdout_gone()
    except (RunFileError, ValueError, OSError, MissingExtra) as e:
        return _fail(str(e) or type(e).__name__)
    except KeyboardInterrupt:
        return _fail("interrupted", status=130)
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


def printable(text: str) -> str:
    """``text`` with control and other invisible characters escaped (names from run files are untrusted:
    a terminal escape sequence in a tensor name must not reach the terminal)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(text))


def _load(path: Path) -> Run:
    return Run.load(path)


def _cmd_info(args) -> int:
    from .report import summary_rows
    runs, failed = [], 0
    for path in args.runs:            # like ls or wc: one error line per unreadable run, the others summarised
        try:
            runs.append((path, _load(Path(path))))
        except RunFileError as e:
            failed = _fail(str(e))
    if args.json and runs:            # strict JSON: no NaN or Infinity tokens (non-finite numbers are null)
        out = {str(path): strict_json(run.summary(args.format)) for path, run in runs}
        print(json.dumps(out if len(args.runs) > 1 else out[str(runs[0][0])], indent=2, allow_nan=False))
    for i, (path, run) in enumerate(runs if not args.json else []):
        rows = summary_rows(run, args.format)
        width = max(len(label) for label, _ in rows)
        print(("\n" if i else "") + printable(path))
        for label, text in rows:
            print(f"  {label:<{width}}  {printable(text)}")
    return failed


def _cmd_doctor(args) -> int:
    """Exit status 1 when a run has a finding of severity "error" (CI can fail on it), else 0."""
    from .doctor import as_text
    runs = [(str(path), _load(Path(path)).diagnose()) for path in args.runs]   # all first: fail before printing
    errors = any(f["severity"] == "error" for _, d in runs for f in d["findings"])
    if args.json:
        out = dict(runs)
        print(json.dumps(out if len(runs) > 1 else runs[0][1], indent=2, allow_nan=False))
        return int(errors)
    print("\n\n".join(as_text(diagnosis, path) for path, diagnosis in runs))
    return int(errors)


def _check_output_file(path: Path) -> None:
    if path.is_dir():
        raise ValueError(f"-o/--output: {path} is a directory; give the HTML file to write, e.g. {path}/report.html")


def _cmd_report(args) -> int:
    require("plotly", "ampviz report")
    from .report import write_report
    _check_output_file(args.output)
    runs = [_load(Path(path)) for path in args.runs]
    labels = [str(path) for path in args.runs]
    write_report(runs, args.output, labels=labels, format=args.format, title=args.title)
    print(f"wrote {args.output} ({args.output.stat().st_size / 1e6:.1f} MB, {len(runs)} run"
          f"{'s' if len(runs) != 1 else ''})")
    return 0


def _cmd_demo(args) -> int:
    for module in ("sklearn", "tqdm", "plotly"):          # its data, its progress bar, its report
        require(module, "ampviz demo")
    from .demo import write_demo
    for line in write_demo(args.output, steps=args.steps, device=args.device, seed=args.seed,
                           progress=not args.quiet):
        print(line)
    return 0


def _cmd_export(args) -> int:
    if args.tensorboard is None and not args.wandb:
        return _fail("export: give --tensorboard DIR, --wandb, or both", status=2)
    from .export import to_tensorboard, to_wandb
    run = _load(Path(args.run))
    if args.tensorboard is not None:
        dirs = to_tensorboard(run, args.tensorboard, domain=args.domain, progress=not args.quiet)
        where = ", ".join(str(d) for d in dirs)
        print(f"wrote {run.n_steps} steps to {where} (view: tensorboard --logdir {args.tensorboard})")
    if args.wandb:
        target = to_wandb(run, domain=args.domain, project=args.wandb_project, progress=not args.quiet)
        print(f"logged {run.n_steps} steps to W&B run {target.name or target.id} in project {args.wandb_project}")
    return 0

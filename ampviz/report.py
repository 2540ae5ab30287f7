"""A run summary in words, and a self-contained HTML report of one or several runs.

``summary_rows`` turns ``Run.summary()`` into labelled lines (``ampviz info`` prints them, the
report shows them as a table). ``write_report`` writes one HTML page with plotly.js inlined (it
opens with no network): per run, the summary, the loss-scale trace, histograms against the
format's ranges at representative steps, the step x bin heatmap, and a per-rank comparison for
DDP runs. Every figure comes from :mod:`ampviz.plots`::

    >>> import ampviz
    >>> from ampviz.report import write_report
    >>> run = ampviz.Run.load("runs/demo/run.npz")              # doctest: +SKIP
    >>> write_report([run], "report.html", labels=["demo"])     # doctest: +SKIP
"""

from __future__ import annotations

import html
import math
import re
import time
from pathlib import Path

import numpy as np

from . import __version__
from . import histogram as H
from ._files import atomic_write
from ._text import lone_surrogate, printable
from .formats import get_format
from .run import Run, holds_run

__all__ = ["write_report", "report_html", "representative_steps", "summary_rows", "worst_without_scaling",
           "format_scale"]


def format_scale(value) -> str:
    """``65536.0`` -> ``"2^16"``; other numbers with 4 significant digits; None -> ``"-"``."""
    if value is None or not np.isfinite(value) or value <= 0:
        return "-" if value is None else f"{value:g}"
    m, e = math.frexp(float(value))
    return f"2^{e - 1}" if m == 0.5 else f"{value:.4g}"


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.3g}%"


def worst_without_scaling(run: Run, format="fp16") -> tuple[float, str | None]:
    """Largest fraction of non-zero values of any tensor and step that would flush to zero in
    ``format`` if the loss were not scaled, and that tensor's name.

    Computed from the unscaled view of every tensor. Activation gradients are recorded as the
    (fp16) backward produced them, so values already flushed there are zeros, not counted: for
    them it is a lower bound.
    """
    flushed = run.fate_in(format, "unscaled").fraction("flushed")                   # (R, H, T)
    if not flushed.size or not flushed.max() > 0:
        return 0.0, None
    return float(flushed.max()), run.tensor_names[int(np.unravel_index(flushed.argmax(), flushed.shape)[2])]


def summary_rows(run: Run, format="fp16") -> list[tuple[str, str]]:
    """The run's summary as (label, text) pairs: steps, loss, scale, skipped, tensors, fates.

    Parameters
    ----------
    run : the run to describe (all ranks).
    format : the format the fractions refer to (name, dtype or Format).

    Returns
    -------
    list of (label, text)
    """
    fmt = get_format(format)
    s = run.summary(fmt.name)
    ranks = s["ranks"]
    rows = [("steps", f"{s['steps']} ({s['histogram_steps']} with histograms), "
                      f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''}, device {s['device']}")]
    if run.n_steps:
        loss = run.loss[0]
        rows.append(("loss", f"{loss[0]:.4g} at step {run.steps[0]} -> {loss[-1]:.4g} at step {run.steps[-1]}"))
    constant = s["scale_min"] == s["scale_max"]
    scale_range = format_scale(s["scale_min"]) + (" (constant)" if constant else f" .. {format_scale(s['scale_max'])}")
    deepspeed = run.meta.get("deepspeed")
    scaler_text = _deepspeed_text(deepspeed) if isinstance(deepspeed, dict) else _scaler_text(s["scaler"])
    rows.append(("loss scale", f"{scale_range}; {scaler_text}"))
    rows.append(("skipped", _skipped_text(run)))
    kinds = {k: run.tensor_kinds.count(k) for k in dict.fromkeys(run.tensor_kinds)}
    domains = run.meta.get("domains", {})
    rows.append(("tensors", f"{s['tensors']}: " + ", ".join(
        f"{n} {k} gradients ({domains.get(k, 'unscaled')})" for k, n in kinds.items())))
    flushed = _flushed_text(s["flushed_in_backward"])
    rows.append((f"{fmt.name} at the recorded scale",
                 (flushed if flushed and fmt.name == "fp16" else
                  f"worst flushed to zero {_worst(s['worst_flushed_fraction'], s['worst_flushed_tensor'])}")
                 + f"; worst overflow {_worst(s['worst_overflow_fraction'], s['worst_overflow_tensor'])}"))
    if flushed and fmt.name != "fp16":
        rows.append(("fp16 backward", flushed))
    if not (constant and s["scale_min"] == 1.0):          # with no scaling at all, the row above says it
        frac, name = worst_without_scaling(run, fmt)
        rows.append((f"{fmt.name} without scaling", f"worst flushed to zero {_worst(frac, name)}"))
    if run.update_steps is not None:
        states = f"; optimizer state: {', '.join(run.state_names)}" if run.state_counts is not None else ""
        rows.append(("weight updates", f"measured at {_steps_span(run.update_steps)}{states}"))
    if run.blocks is not None:
        b = run.blocks
        rows.append(("block statistics", f"{_steps_span(b.steps)}, {len(dict.fromkeys(b.modules))} Linear modules, "
                                         f"layouts {', '.join(lay.name for lay in b.layouts)}"))
    if "demo" in run.meta:
        rows.append(("test accuracy", f"{100 * run.meta['demo']['test_accuracy']:.1f}% (ampviz demo)"))
    return rows


def _steps_span(steps) -> str:
    """``"3 steps (0 to 200)"``: how many steps and the first and last."""
    n = len(steps)
    return f"{n} step{'s' if n != 1 else ''}" + (f" ({steps[0]} to {steps[-1]})" if n > 1 else
                                                  f" ({steps[0]})" if n else "")


def _flushed_text(flushed: list) -> str:
    """What the zeros of tensors that fp16 flushed inside the backward are (``Run.summary()["flushed_in_backward"]``);
    "" when none."""
    if not flushed:
        return ""
    x = flushed[0]
    n, judged = len(x["steps"]), x["judged_steps"]
    worst = (f"{x['tensor']} all zeros at {n} of {judged} steps" if x["all_zero_steps"] == n else
             f"{x['tensor']} at fp16's floor at {n} of {judged} steps ({_percent(x['zero_share'])} exact zeros)")
    more = len(flushed) - 1
    return (f"flushed inside the fp16 backward, stored as exact zeros: {worst}"
            + (f", and {more} more tensor{'s' if more != 1 else ''}" if more else "") + " (see ampviz doctor)")


def _worst(fraction: float, tensor) -> str:
    return f"{_percent(fraction)} ({tensor})" if fraction > 0 and tensor else "0%"


def _deepspeed_text(ds: dict) -> str:
    """The loss scaler of a run recorded from a DeepSpeed engine (``run.meta["deepspeed"]``)."""
    where = f"DeepSpeed ZeRO {ds.get('stage')} {ds.get('dtype')}"
    if not ds.get("dynamic_loss_scale"):
        return f"{where}, no dynamic loss scaling"
    parts = [f"min {format_scale(ds['min_loss_scale'])}" if ds.get("min_loss_scale") is not None else "",
             f"hysteresis {ds['hysteresis']}" if ds.get("hysteresis") is not None else "",
             f"x2 after {ds['scale_window']} clean steps" if ds.get("scale_window") is not None else ""]
    return f"{where}, dynamic loss scaler ({', '.join(p for p in parts if p)})"


def _scaler_text(scaler) -> str:
    if not scaler:
        return "no GradScaler"
    if not all(k in scaler for k in ("init_scale", "growth_factor", "growth_interval", "backoff_factor")):
        return "a loss scaler (settings not recorded)"
    return (f"GradScaler(init {format_scale(scaler['init_scale'])}, x{scaler['growth_factor']:g} after "
            f"{scaler['growth_interval']} clean steps, x{scaler['backoff_factor']:g} on inf/nan)")


def _skipped_text(run: Run) -> str:
    per_rank = run.skipped.sum(axis=1) if run.skipped.size else np.zeros(len(run.ranks), dtype=int)
    n, total = int(per_rank[0]), run.n_steps
    text = f"{n} of {total} steps ({_percent(n / total if total else 0.0)})"
    if n:
        first = run.steps[np.flatnonzero(run.skipped[0])[:3]].tolist()
        text += f", first at steps {', '.join(map(str, first))}"
    if len(run.ranks) > 1:
        text += "; per rank " + ", ".join(f"rank {r}: {int(k)}" for r, k in zip(run.ranks, per_rank))
    return text


def rows_as_html(rows: list[tuple[str, str]]) -> str:
    """An HTML table of (label, text) rows, escaped."""
    body = "".join(f"<tr><th>{html.escape(a)}</th><td>{html.escape(b)}</td></tr>" for a, b in rows)
    return f'<table class="summary">{body}</table>'


# ---------------------------------------------------------------------------- the HTML page
_CSS = """body{font-family:Inter,Helvetica Neue,Arial,sans-serif;color:#222;max-width:1180px;margin:24px auto;
padding:0 16px}h1{font-size:24px}h2{font-size:20px;margin-top:40px;border-bottom:1px solid #ddd}
h3{font-size:16px;margin-top:28px}p.note{color:#555;font-size:13px}table.summary{border-collapse:collapse;
font-size:14px}table.summary th{text-align:left;padding:3px 16px 3px 0;color:#555;font-weight:normal;
vertical-align:top}table.summary td{padding:3px 0;font-family:ui-monospace,Menlo,monospace;font-size:13px}
nav a{margin-right:16px}"""


_WITHOUT_SCALING = "worst underflow without scaling"


def _shown_scale(why: str, recorded_log2: int) -> int:
    """The log2 scale a histogram is shaded at: 0 (no scaling) for the "without scaling" pick."""
    return 0 if why.startswith(_WITHOUT_SCALING) else int(recorded_log2)


def representative_steps(run: Run, format="fp16", rank=None) -> list[tuple[int, str]]:
    """Histogram steps worth showing, each with the reason: first, worst underflow, first skipped, last.

    ``rank`` is a rank id (one of ``run.ranks``), the first rank by default.
    "Worst underflow" is the step whose values (all tensors) lose the largest share to zero in
    ``format`` at the loss scale the step used; when no step loses any, the step that would lose
    the most without scaling.
    """
    if run.hist_steps.size == 0:
        return []
    fmt = get_format(format)
    picks = [(0, "first step")]
    for domain, why in (("scaled", "worst underflow"), ("unscaled", _WITHOUT_SCALING)):
        flushed = H.fate(run.pooled_counts(domain, rank=rank), fmt, 1.0).fraction("flushed")           # (H,)
        if flushed.max() > 0:
            picks.append((int(flushed.argmax()), f"{why}: {_percent(flushed.max())} flushed"))
            break
    r = 0 if rank is None else run.rank_index(rank)
    skipped = np.flatnonzero(run.skipped[r][np.searchsorted(run.steps, run.hist_steps)])
    if skipped.size:
        picks.append((int(skipped[0]), "first skipped step"))
    picks.append((run.hist_steps.size - 1, "last step"))
    seen, out = set(), []
    for row, why in sorted(picks, key=lambda p: p[0]):
        if row not in seen:
            seen.add(row)
            out.append((int(run.hist_steps[row]), why))
    return out


def report_html(runs, labels=None, format="fp16", title: str = "ampviz report") -> str:
    """The report page as a string: one section per run, plotly.js inlined once (no network).

    Parameters
    ----------
    runs : a Run or a list of Runs (a multi-rank Run gets a per-rank comparison).
    labels : one heading per run (default "run 1", "run 2", ...).
    format : the format histograms and fractions are judged against.
    title : the page title.
    """
    from plotly.offline import get_plotlyjs
    runs = [runs] if isinstance(runs, Run) else list(runs)
    if not runs or not all(isinstance(r, Run) for r in runs):
        raise ValueError(f"runs: expected one or more ampviz.Run, got {runs!r:.80}")
    labels = [f"run {i + 1}" for i in range(len(runs))] if labels is None else [str(x) for x in labels]
    if len(labels) != len(runs):
        raise ValueError(f"labels: expected {len(runs)} labels (one per run), got {len(labels)}")
    fmt = get_format(format)
    title = _shown_text("title", title)
    labels = [_shown_text(f"labels[{i}]", lab) for i, lab in enumerate(labels)]
    nav = "".join(f'<a href="#run{i}">{html.escape(lab)}</a>' for i, lab in enumerate(labels))
    body = "".join(_run_section(run, lab, fmt, f"run{i}") for i, (run, lab) in enumerate(zip(runs, labels)))
    made = time.strftime("%Y-%m-%d %H:%M")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<style>{_CSS}</style><script type="text/javascript">{get_plotlyjs()}</script></head><body>'
            f'<h1>{html.escape(title)}</h1><p class="note">ampviz {__version__}, {made}; fractions against '
            f'{fmt.name}. Weight gradients are stored unscaled, activation gradients as the backward computed '
            f'them (scaled).</p>' + (f"<nav>{nav}</nav>" if len(runs) > 1 else "") + body + "</body></html>")


def _shown_text(name: str, text) -> str:
    """``text`` for the page: control and bidi characters escaped; a lone surrogate (bytes that were not
    UTF-8, e.g. a non-UTF-8 title on the command line) refused, naming ``name``."""
    text = str(text)
    bad = lone_surrogate(text)
    if bad and name == "title":
        raise ValueError(f"title: '{printable(text)}' holds {bad}, a byte that is not UTF-8 text; give the title "
                         "as UTF-8 text")
    return printable(text)                    # a label is a path: a non-UTF-8 file name is shown escaped


def check_output(path, name: str = "path") -> Path:
    """``path`` as a Path if a report may be written there: not a directory, not a file holding an ampviz
    run (a report never replaces a run), not a name ending in ``.npz`` (the ending of run files). Errors
    name the argument ``name``."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{name}: {printable(path)} is a directory; give the HTML file to write, e.g. "
                         f"{printable(path / 'report.html')}")
    if holds_run(path):
        raise ValueError(f"{name}: {printable(path)} holds an ampviz run; a report never replaces a run, give "
                         "another file name")
    if path.suffix.lower() == ".npz":
        raise ValueError(f"{name}: {printable(path)} ends in .npz, the ending of run files; give an .html file")
    return path


def write_report(runs, path, labels=None, format="fp16", title: str = "ampviz report") -> Path:
    """Write :func:`report_html` to ``path`` atomically (parent directories are created). A path that is a
    directory, ends in ``.npz`` or holds an ampviz run is refused (:func:`check_output`).

    Returns
    -------
    Path of the written file.
    """
    path = check_output(path)
    page = report_html(runs, labels=labels, format=format, title=title)
    atomic_write(path, lambda f: f.write(page), text=True)
    return path


def _figure_html(fig, div_id: str) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                       config={"displaylogo": False, "responsive": True})


def _run_section(run: Run, label: str, fmt, anchor: str) -> str:
    from .doctor import as_html as findings_html
    from .plots import rank_comparison_figure, scale_trace_figure
    from .replay import trace_from_run
    parts = [f'<h2 id="{anchor}">{html.escape(label)}</h2>', findings_html(run.diagnose()),
             rows_as_html(summary_rows(run, fmt))]
    if run.n_steps:
        ceiling = trace_from_run(run, fmt) if run.hist_steps.size and run.meta.get("scaler") else None
        parts.append(_figure_html(scale_trace_figure(run.steps, run.loss_scale[0], run.skipped[0], run.grown[0],
                                                     trace=ceiling, format=fmt), f"{anchor}-scale"))
    if run.hist_steps.size:
        parts += _histogram_parts(run, fmt, anchor)
    if len(run.ranks) > 1 and run.hist_steps.size:
        parts.append("<h3>Ranks</h3>" + _note("One line per rank: lines that should coincide and do not point "
                                              "at a rank that diverged."))
        parts.append(_figure_html(rank_comparison_figure(run, fmt), f"{anchor}-ranks"))
    return "".join(parts)


def _note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def _histogram_parts(run: Run, fmt, anchor: str) -> list[str]:
    """Histograms at representative steps (all tensors), per tensor at the worst step, heatmaps (rank 0)."""
    from .plots import heatmap_figure, histogram_figure
    if not run.tensor_names:
        return ["<h3>Gradient magnitudes</h3>" + _note("No tensors were recorded in this run: no histograms.")]
    pooled = run.pooled_counts("unscaled")                                      # (H, NBINS)
    log2s = run.log2_scales()[0]                                               # (H,)
    steps = representative_steps(run, fmt)
    parts = [f"<h3>Gradient magnitudes against {fmt.name}</h3>" + _note(
        f"All tensors of rank {run.ranks[0]}, unscaled; the shading shows where each value lands at the loss "
        "scale that step used (at scale 1 for the step that would lose most without scaling).")]
    for step, why in steps:
        h = run.hist_index(step)
        fig = histogram_figure(pooled[h], fmt, _shown_scale(why, log2s[h]), title=f"Step {step} ({why})")
        parts.append(_figure_html(fig, f"{anchor}-hist-{int(step)}"))
    step, why = next(((s, w) for s, w in steps if w.startswith("worst")), steps[-1])
    h = run.hist_index(step)
    parts += [f"<h3>Per tensor at step {step} ({html.escape(why)})</h3>"]
    parts += _tensor_parts(run, fmt, anchor, h, _shown_scale(why, log2s[h]))
    parts.append("<h3>Over the run</h3>")
    for kind in dict.fromkeys(run.tensor_kinds):
        fig = heatmap_figure(run.pooled_counts("unscaled", kind=kind), run.hist_steps, fmt, log2s,
                             title=f"{html.escape(kind.capitalize())} gradients per step (unscaled)")
        parts.append(_figure_html(fig, f"{anchor}-heatmap-{_safe_id(kind)}"))
    return parts


SMALL_MULTIPLES = 24        # per-tensor panels drawn at most; a run with more tensors also gets the tensor map


def _tensor_parts(run: Run, fmt, anchor: str, row: int, log2_scale: int) -> list[str]:
    """Small multiples of every tensor; with more than SMALL_MULTIPLES, a map of all and multiples of the worst."""
    from .doctor import flushed_in_backward
    from .plots import layer_histograms_figure, tensor_map_figure
    counts, names = run.counts_at(row), run.tensor_names                       # (T, NBINS)
    step = int(run.hist_steps[row])
    parts, picked = [], list(range(len(names)))
    if len(names) > SMALL_MULTIPLES:
        fig = tensor_map_figure(counts, names, fmt, log2_scale, kinds=run.tensor_kinds,
                                title=f"Every tensor at step {step}")
        fate = H.fate(counts, fmt, log2_scale=log2_scale)
        lost = fate.fraction("flushed") + fate.fraction("overflow")            # (T,)
        picked = sorted(np.argsort(-lost, kind="stable")[:SMALL_MULTIPLES].tolist())
        flushed = [x["tensor"] for x in flushed_in_backward(run) if step in x["steps"]]
        what = (f"the {SMALL_MULTIPLES} that lose the largest share to {fmt.name} (flushed or overflowed)"
                if lost.max() > 0 else
                f"the {min(len(flushed), SMALL_MULTIPLES)} whose values the fp16 backward had already flushed to "
                f"exact zeros, then the first others" if flushed else
                f"none loses a value to {fmt.name}; the first {SMALL_MULTIPLES}")
        if not lost.max() > 0 and flushed:                 # the recorded values lose nothing more: show the flushed
            first = [names.index(n) for n in flushed[:SMALL_MULTIPLES]]
            picked = sorted(first + [t for t in range(len(names)) if t not in first][:SMALL_MULTIPLES - len(first)])
        parts += [_note(f"{len(names)} tensors: one row each in the map (hover for names), then {what}, in "
                        "recording order."), _figure_html(fig, f"{anchor}-tensor-map")]
    fig = layer_histograms_figure(counts[picked], [names[i] for i in picked], fmt, log2_scale,
                                  title=f"Gradient magnitudes per tensor, step {step}")
    return parts + [_figure_html(fig, f"{anchor}-tensors")]


def _safe_id(text: str) -> str:
    """An HTML id fragment from untrusted text: letters, digits, '-' and '_' only."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", str(text))[:40]

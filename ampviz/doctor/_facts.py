"""What every check of the doctor reads from a run: its formats, row groups, non-finite counts, maxima.

One :class:`Facts` per diagnosis; the checks in ``_nonfinite``, ``_scale`` and ``_switch`` share it, so
each derived array is computed once. Also the plain-data helpers every check uses to build findings.
"""

from __future__ import annotations

import math

import numpy as np

from .. import histogram as H
from ..formats import get_format
from ..run import Run

GRADIENT_KINDS = ("weight", "activation", "weight_local")
SEVERITIES = ("error", "warning", "info")

# a skipped step counts as a loss-scale overflow when its finite scaled gradients (or its clean
# neighbours' at its scale) reach within this many binades of the format's largest binade
EDGE_BINADES = 2
NEIGHBOURS = 4              # clean histogram rows looked at on each side of a skipped step
CLIPPED_INF, CLIPPED_NAN = 1, 2     # how clip_grad_norm_ rewrote a non-finite step's weight gradients (Facts.clipped)


def finding(check: str, severity: str, summary: str, *, recommendation: str, steps=(), tensors=(), ranks=(),
            evidence=None, details=()) -> dict:
    """One finding as plain data (see ``ampviz.doctor``'s docstring for the fields)."""
    assert severity in SEVERITIES, severity
    return {"check": check, "severity": severity, "summary": summary, "ranks": [int(r) for r in ranks],
            "steps": [int(s) for s in steps], "tensors": [str(t) for t in tensors],
            "evidence": plain(evidence or {}), "details": [str(d) for d in details],
            "recommendation": recommendation}


def plain(value):
    """``value`` as JSON-safe plain data: dicts, lists, str, int, float, bool, None; non-finite floats as
    the strings "inf", "-inf", "nan" (strict JSON has no such numbers)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [plain(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        v = float(value)
        return v if math.isfinite(v) else ("nan" if v != v else ("inf" if v > 0 else "-inf"))
    if value is None or isinstance(value, str):
        return value
    raise TypeError(f"not plain data: {type(value).__name__}")


def scale_text(value) -> str:
    """``65536.0`` -> ``"2^16"``; other numbers with 4 significant digits."""
    value = float(value)
    if value > 0 and math.isfinite(value):
        m, e = math.frexp(value)
        if m == 0.5:
            return f"2^{e - 1}"
    return f"{value:.4g}"


def steps_text(steps, limit: int = 8) -> str:
    """``[3, 4, 5, 9]`` -> ``"3-5, 9"`` (runs of consecutive steps joined), at most ``limit`` pieces."""
    steps = [int(s) for s in steps]
    pieces, i = [], 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        pieces.append(str(steps[i]) if i == j else f"{steps[i]}-{steps[j]}")
        i = j + 1
    if len(pieces) <= limit:
        return ", ".join(pieces)
    shown = sum(1 if "-" not in p else int(p.split("-")[1]) - int(p.split("-")[0]) + 1 for p in pieces[:limit])
    more = len(steps) - shown
    return ", ".join(pieces[:limit]) + f" and {more} more step{'s' if more != 1 else ''}"


def percent_range(lo: float, hi: float) -> str:
    """``"3%"`` when the bounds agree, else ``"3% to 5%"``."""
    a, b = percent(lo), percent(hi)
    return a if a == b else f"{a} to {b}"


def names_text(names, limit: int = 5) -> str:
    names = list(names)
    more = len(names) - limit
    return ", ".join(names[:limit]) + (f" and {more} more" if more > 0 else "")


def best_static_log2(trace: np.ndarray, fmt) -> int | None:
    """log2 of the largest static scale at which no finite step of a gradient trace (``ampviz.replay.trace_from_run``)
    overflows ``fmt``; None when the trace has no finite non-zero step. Trace values are binades' lower edges
    2**k, so k + s <= emax never overflows."""
    finite = trace[np.isfinite(trace) & (trace > 0)]
    if not finite.size:
        return None
    return min(int(fmt.emax - math.floor(math.log2(finite.max()))), 127)


def percent(fraction: float) -> str:
    return f"{100 * fraction:.3g}%"


class Facts:
    """A run and what the checks derive from it (computed once, lazily where costly).

    Attributes
    ----------
    run : the Run.
    precision : "fp16", "bf16" or "fp32": the dtype the model computed in (from the recorded activation-gradient,
        output and weight-gradient dtypes: autocast's, or a pure-bf16/fp16 model's), "fp16" for a GradScaler run
        that recorded no half-precision row.
    grad_format : the format the scaled gradients were computed in (its overflow threshold decides skips).
    grad_rows, output_rows : tensor indices of gradient rows (weight, activation, weight_local) and of
        forward-output rows.
    weight_rows : tensor indices of the (reduced, as the optimizer sees them) weight-gradient rows.
    partitioned : each rank recorded only its own partition of the gradients (DeepSpeed ZeRO 1 to 3).
    loss_scaled : the backward ran multiplied by a loss scale (a GradScaler, DeepSpeed's fp16 scaler).
    dynamic_scaler : that scale was a dynamic scaler's whose settings the run holds (``meta["scaler"]``, or
        DeepSpeed's fp16 ``scale_window`` and ``min_loss_scale``): the scale checks read its trace.
    """

    def __init__(self, run: Run):
        if not isinstance(run, Run):
            raise TypeError(f"run: expected an ampviz.Run, got {type(run).__name__}")
        self.run = run
        self.grad_rows = run.tensors_of(GRADIENT_KINDS)
        self.output_rows = run.tensors_of("output")
        self.weight_rows = run.tensors_of("weight")
        # weight gradients count too: a pure-bf16 (or fp16) model recorded with activations=False has no other
        # row in its compute dtype (an AMP run's weight gradients are fp32, its master weights')
        dtypes = {run.tensor_dtypes[t] for t in run.tensors_of(("activation", "output", "weight"))}
        self.has_scaler = bool(run.meta.get("scaler"))
        # the GradScaler given to the Recorder never stepped while it recorded steps (files from ampviz 0.x before
        # "steps_called" was recorded: unknown, taken as used): its scale and skips are not the loop's
        self.scaler_unused = self.has_scaler and run.n_steps > 0 and run.meta["scaler"].get("steps_called") == 0
        # the backward ran multiplied by a loss scale: a GradScaler, or DeepSpeed's own fp16 scaler
        # (``ampviz.integrations.deepspeed``); then an overflow can be the scale's doing
        deepspeed = run.meta.get("deepspeed")
        ds: dict = deepspeed if isinstance(deepspeed, dict) else {}
        self.loss_scaled = self.has_scaler or ds.get("dtype") == "fp16"
        # each rank holds only its own part of the gradients (DeepSpeed ZeRO 1 to 3): a step overflows when any
        # rank's part does, so its cause is read from all ranks together
        self.partitioned = ds.get("weights") == "partition"
        # a scaler that backs off and grows, whose trace the scale checks read: GradScaler's, or DeepSpeed's
        # DynamicLossScaler (its own settings, ``ampviz.replay.policy_from_run``)
        # (a DeepSpeed run whose meta lacks the scaler's settings cannot be read as one)
        self.dynamic_scaler = self.has_scaler or (ds.get("dtype") == "fp16" and bool(ds.get("dynamic_loss_scale"))
                                                  and ds.get("scale_window") is not None
                                                  and ds.get("min_loss_scale") is not None)
        if "torch.float16" in dtypes or (self.loss_scaled and "torch.bfloat16" not in dtypes):
            self.precision = "fp16"
        elif "torch.bfloat16" in dtypes:
            self.precision = "bf16"
        else:
            self.precision = "fp32"
        self.grad_format = get_format(self.precision)
        self.hist_pos = np.searchsorted(run.steps, run.hist_steps)          # (H,) step position of each row
        self._cache: dict = {}

    @property
    def n_ranks(self) -> int:
        return len(self.run.ranks)

    def row_of_step(self, position: int | np.integer) -> int | None:
        """The histogram row of the step at ``position`` in ``run.steps``, or None."""
        h = int(np.searchsorted(self.hist_pos, position))
        return h if h < self.hist_pos.size and self.hist_pos[h] == position else None

    def nonfinite(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """(H, T) counts of inf (or beyond 2**127) and of nan values, per row and tensor, of rank index r.

        On a row clipped with an infinite norm (``clipped``) the weight rows' nan are counted as inf: they were
        inf before the clip multiplied every gradient by 0.
        """
        key = ("nonfinite", r)
        if key not in self._cache:
            c = self.run.counts[r]
            inf, nan = c[:, :, H.ABOVE].copy(), c[:, :, H.NAN].copy()
            rows = np.flatnonzero(self.clipped(r) == CLIPPED_INF)
            if rows.size and self.weight_rows:
                w = np.ix_(rows, self.weight_rows)
                inf[w] += nan[w]
                nan[w] = 0
            self._cache[key] = (inf, nan)
        return self._cache[key]

    def clipped(self, r: int) -> np.ndarray:
        """(H,) per histogram row of rank index r: 0, or how ``clip_grad_norm_`` rewrote the weight gradients of
        a step whose gradients were not finite (``scaler.unscale_(opt); clip_grad_norm_(...)``, Lightning's
        ``gradient_clip_val``, HF Trainer's ``max_grad_norm``): ``CLIPPED_INF`` (the total norm was inf: every
        gradient multiplied by 0, inf became nan and finite values 0) or ``CLIPPED_NAN`` (the norm was nan: every
        value became nan). Read from the weight rows: no finite non-zero value left, some nan, no inf; never for
        a GradScaler run whose loop did not call ``scaler.unscale_`` before ``scaler.step``
        (``meta["unscaled_before_step"]``)."""
        key = ("clipped", r)
        if key not in self._cache:
            out = np.zeros(self.run.hist_steps.size, dtype=np.int8)
            # a GradScaler run whose loop never unscaled before scaler.step did not clip unscaled gradients
            if self.weight_rows and self.run.meta.get("unscaled_before_step") is not False:
                c = self.run.counts[r][:, self.weight_rows]                       # (H, W, NBINS)
                finite = c[:, :, H.BELOW:H.ABOVE].sum(axis=(1, 2))
                hit = (finite == 0) & (c[:, :, H.ABOVE].sum(axis=1) == 0) & (c[:, :, H.NAN].sum(axis=1) > 0)
                out[hit] = np.where(c[hit][:, :, H.ZERO].sum(axis=1) > 0, CLIPPED_INF, CLIPPED_NAN)
            self._cache[key] = out
        return self._cache[key]

    def empty_rows(self, rows) -> list:
        """The tensor indices among ``rows`` that hold no value at any recorded step of any rank (never filled)."""
        if not self.run.hist_steps.size:
            return list(rows)
        return [t for t in rows if not self.run.counts[:, :, t].any()]

    def finite_top(self, r: int, domain: str) -> np.ndarray:
        """(H, T) binade exponent k of the highest non-empty finite binade (2**k, 2**(k+1)] in ``domain``;
        -inf where a row holds no finite non-zero value."""
        key = ("top", r, domain)
        if key not in self._cache:
            out = np.full(tuple(self.run.counts.shape[1:3]), -np.inf)
            exps = np.concatenate([[-127], H.binade_exponents()])           # "below" and the binades
            for t in range(out.shape[1]):                                   # one tensor at a time
                c = self.run.tensor_counts(t, domain, rank=self.run.ranks[r])[:, H.BELOW:H.ABOVE] > 0       # (H, 254)
                hit = c.any(axis=1)
                top = c.shape[1] - 1 - np.argmax(c[:, ::-1], axis=1)
                out[:, t] = np.where(hit, exps[top], -np.inf)
            self._cache[key] = out
        return self._cache[key]

    def edge_exponent(self) -> int:
        """Binade exponent from which a scaled gradient counts as "at the edge" of overflowing."""
        return self.grad_format.emax - EDGE_BINADES

    def backward_rank(self, r: int, h: int) -> tuple[np.ndarray, bool]:
        """(T,) position of each tensor in the backward order of row ``h`` (smaller: closer to the loss),
        and whether that order was recorded (False: guessed from module order).

        A recorded ``grad_order`` is used where it is >= 0. A weight without one is placed just after its
        module's activation gradient (a module's weight gradients are computed right after the gradient
        of its output); activation gradients without an order are guessed in reverse module order.
        """
        run, T = self.run, len(self.run.tensor_names)
        order = np.full(T, np.nan)
        known = False
        if run.grad_order is not None:
            rec = run.grad_order[r, h].astype(float)
            order = np.where(rec >= 0, rec, np.nan)
            known = bool(np.any(rec >= 0))
        act = {run.tensor_names[t]: t for t in run.tensors_of("activation")}
        n_act = len(act)
        for i, t in enumerate(act.values()):
            if np.isnan(order[t]):
                order[t] = T + (n_act - i)               # guessed: later modules are closer to the loss
        for t in run.tensors_of(("weight", "weight_local")):
            if np.isnan(order[t]):
                module = run.tensor_names[t].removesuffix(" [local]").rsplit(".", 1)[0]
                order[t] = order[act[module]] + 0.5 if module in act else 3 * T + t
        return np.where(np.isnan(order), 4 * T, order), known

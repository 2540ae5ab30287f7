"""ampviz for DeepSpeed: a Recorder built in one line from a ``DeepSpeedEngine``, for ZeRO stages 0 to 3.

::

    from ampviz.integrations.deepspeed import Recorder

    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    rec = Recorder(engine, path="runs/ds.npz")          # the one line
    with rec:
        for x, y in loader:
            loss = F.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            rec.step(loss)            # after every engine.step(), micro-batches included

It is an ``ampviz.Recorder`` on ``engine.module`` whose weight gradients and loss scale come from the engine:

* **weight gradients** are read just before the engine's optimizer steps (``engine.optimizer.step`` is wrapped
  on the instance while recording, put back on exit), where DeepSpeed keeps them:

  - ZeRO 0: each parameter's ``.grad`` (all-reduced: every rank counts the full gradient);
  - ZeRO 1 and 2: this rank's partition of the averaged gradients (``optimizer.averaged_gradients``), split
    per parameter by DeepSpeed's own fragment mapping (``param._hp_mapping``, the one ``safe_get_full_grad``
    reads before it all-reduces); a parameter with no fragment on this rank leaves its row empty. ZeRO 1 with bf16
    parameters and fp32 gradient accumulation runs ``BF16_Optimizer``, which keeps a full fp32 gradient on every
    rank: only this rank's fragment of it is counted;
  - ZeRO 3: each parameter's local gradient partition (what ``safe_get_local_grad`` returns, read from the
    optimizer's partition dict without its fp32 copy), without the padding of the last partition.

  Under ZeRO 1 to 3 each rank counts its own disjoint part, so the ranks' counts add up to the histogram of the
  full gradient (``run.meta["deepspeed"]["weights"]`` is ``"partition"``; ``"full"`` under ZeRO 0). Nothing is
  gathered. The rows stay one per parameter, named as in ``engine.module``. Domain: **unscaled**, as every
  Recorder's weight rows: DeepSpeed's fp16 gradients are still multiplied by the loss scale before ``step()``,
  so they are divided in fp32 by the scale the backward used (a power of two: exact) before counting; DeepSpeed has
  already divided the loss by ``gradient_accumulation_steps`` in ``engine.backward``, so they are the mean over
  the micro-batches, as the optimizer sees them (before clipping).
* **activation gradients** (and ``outputs=``) come from module hooks on ``engine.module``, as for any model:
  scaled, per micro-batch, added up over the step.
* **loss scale and skipped steps** come from the engine: the scale is the optimizer's (``loss_scaler.cur_scale``,
  ``cur_scale`` or ``loss_scale``: 1 under bf16, which has no loss scaling), read after each step; a step is
  skipped when ``engine.was_step_applied()`` is False after the optimizer stepped (DeepSpeed skips a step whose
  gradients are non-finite, under bf16 too, where the scale never moves). ``run.meta["deepspeed"]`` holds the
  stage, dtype, ``gradient_accumulation_steps``, the fp16 scaler's settings (``init_scale``: its scale when the
  recording began; ``min_loss_scale``, ``hysteresis``, ``scale_window``, ``scale_factor``,
  ``consecutive_hysteresis``, ``raise_error_at_min_scale``; ``scaler_start``: its counters then) and the engine's
  own ``skipped_steps`` at the end. ``ampviz.replay.policy_from_run`` builds DeepSpeed's scaler from them, which the
  doctor's scale findings judge the trace by (and silent skips of bf16 runs; a scale pinned at ``min_loss_scale``).

``rec.step(loss)`` may be called after every ``engine.step()``: a step is recorded only when the engine's
optimizer really stepped (the gradient-accumulation boundary), with the mean of the losses given since the last
recorded step. Importing this module does not import ``deepspeed`` (an engine is told by its class names); the
recording reads ``deepspeed.__version__`` into ``run.meta`` once the loop has imported it.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import record

__all__ = ["Recorder", "is_engine"]


def is_engine(obj: Any) -> bool:
    """``obj`` is a ``deepspeed.DeepSpeedEngine`` (or a subclass: pipeline, hybrid engines), told by its class
    names, without importing deepspeed."""
    return any(c.__name__ == "DeepSpeedEngine" and c.__module__.startswith("deepspeed")
               for c in type(obj).__mro__)


class Recorder(record.Recorder):
    """An ``ampviz.Recorder`` for a training loop driven by a DeepSpeed ``engine``.

    Parameters
    ----------
    engine : the ``DeepSpeedEngine`` returned by ``deepspeed.initialize`` (ZeRO stage 0, 1, 2 or 3).
    options, **kw : every other ``ampviz.Recorder`` option (``path=``, ``weights=``, ``activations=``, ``every=``,
        ...), as an ``ampviz.RecordOptions`` and/or keywords, as for ``ampviz.Recorder``; not ``optimizer``,
        ``scaler`` or ``local_weights`` (the engine holds them).
    """

    def __init__(self, engine: Any, *, options: record.RecordOptions | None = None, **kw: Any) -> None:
        if not is_engine(engine):
            raise TypeError(f"engine: expected a deepspeed.DeepSpeedEngine (what deepspeed.initialize returns "
                            f"first), got {type(engine).__name__}")
        for name in ("optimizer", "scaler"):
            if name in kw:
                raise TypeError(f"{name}: taken from the engine (engine.optimizer, its loss scaler); do not pass it")
        stage = int(engine.zero_optimization_stage())
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"engine: ZeRO stage {stage} is not supported; valid: 0, 1, 2, 3")
        if getattr(engine, "optimizer", None) is None:
            raise ValueError("engine: has no optimizer (deepspeed.initialize without one): there is no step to "
                             "record; give deepspeed.initialize an optimizer or an optimizer config")
        super().__init__(engine.module, None, scaler=None, options=options, **kw)
        if self.options.local_weights:
            raise ValueError("local_weights: True is not supported with DeepSpeed (its gradients are reduced in "
                             "buckets, not by a DistributedDataParallel wrapper); leave it False")
        self.engine, self.stage = engine, stage
        self._framework = _Engine(engine, stage, self._params)
        self._loss_sum: Any = None
        self._losses = 0

    def step(self, loss: Any = None) -> None:
        """Call after every ``engine.step()``; records a step when the engine's optimizer really stepped (the
        gradient-accumulation boundary), with the mean of the losses given since the last recorded step."""
        if not self.enabled:
            return
        if self._recording is None:
            raise RuntimeError("Recorder.step() called outside `with recorder:`")
        if loss is not None:
            value = loss.detach().reshape(()).float() if isinstance(loss, torch.Tensor) else float(loss)
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value    # on the device: no sync
            self._losses += 1
        if not self._framework.take_stepped():
            return                                    # a micro-batch of an accumulated step
        mean = None if self._loss_sum is None else self._loss_sum / self._losses
        self._loss_sum, self._losses = None, 0
        super().step(mean)


class _Engine:
    """What a recording reads from a DeepSpeed engine (``_Recording.framework``): the weight gradients where the
    ZeRO stage keeps them (``install``), the loss scale, the skipped flag and the facts for ``run.meta``."""

    def __init__(self, engine: Any, stage: int, params: list) -> None:
        self.engine, self.stage = engine, stage
        self.rows = [(i, p) for i, (_, p) in enumerate(params)]
        self.stepped = 0                               # optimizer steps since the last recorded step
        self.start: dict = {}

    # ------------------------------------------------------------------ the optimizer's step, wrapped
    def install(self, capture: Any) -> _StepWatch:
        self.start = self._state()                     # where the scaler stood when the recording began
        return _StepWatch(self, capture)

    def take_stepped(self) -> bool:
        stepped, self.stepped = self.stepped, 0
        return stepped > 0

    def parts(self):
        """(row, tensor) of this rank's part of each watched parameter's gradient, unscaled; read before the
        optimizer steps. A generator: only read on recorded steps."""
        scale = self.scale()
        for row, p in self.rows:
            g = self._local(p)
            if g is not None and scale != 1.0:
                # in fp32, as DeepSpeed unscales: dividing an fp16 gradient in fp16 would flush its smallest values
                # (a temporary per tensor, no host sync; by a power of two: exact)
                g = g.float().div_(scale)
            yield row, g

    def _local(self, p: Any):
        if self.stage == 0:
            return p.grad
        if self.stage == 3:
            return self._zero3_local(p)
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:                            # no fragment of p in this rank's partition
            return None
        frag = mapping.get_lp_grad_fragment(p._index_in_param_group)
        address = mapping.lp_fragment_address
        flat = frag.reshape(-1)
        if flat.numel() == p.numel() and address.numel != p.numel():
            # as deepspeed.utils.tensor_fragment.get_full_hp_grad: a full buffer kept on every rank; this rank's
            # fragment of it only
            flat = flat.narrow(0, address.start, address.numel)
        return flat

    def _zero3_local(self, p: Any):
        if not getattr(p, "requires_grad", False):
            return None
        opt = self.engine.optimizer
        grads = getattr(opt, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", None)
        if grads is not None and not getattr(opt, "offload_optimizer", False):
            g = grads.get(p.ds_id)                     # the partition itself: no fp32 copy (None: no gradient)
        else:
            from deepspeed.utils import safe_get_local_grad
            g = safe_get_local_grad(p)
        if g is None:
            return None
        g = g.reshape(-1)
        part = g.numel()
        rank = opt._get_param_partition_rank(p) if hasattr(opt, "_get_param_partition_rank") else 0
        real = max(0, min(part, int(p.ds_numel) - rank * part))     # the last partition is padded
        return g if real == part else g.narrow(0, 0, real)

    # ------------------------------------------------------------------ scale, skips, meta
    def _scaler(self) -> Any:
        return getattr(self.engine.optimizer, "loss_scaler", None)

    def scale(self) -> float:
        """The optimizer's current loss scale (after its last update), a host number (no sync)."""
        opt = self.engine.optimizer
        scaler = self._scaler()
        for obj, name in ((scaler, "cur_scale"), (opt, "cur_scale"), (opt, "loss_scale")):
            value = getattr(obj, name, None) if obj is not None else None
            if value is not None:
                return float(value)
        return 1.0

    def _state(self) -> dict:
        """The scale and the counters of the dynamic scaler (a DynamicLossScaler, or ZeRO 0's loss_scale_config)."""
        holder = self._scaler() or getattr(self.engine.optimizer, "loss_scale_config", None)
        state = {name: getattr(holder, name, None) for name in ("cur_iter", "last_overflow_iter", "cur_hysteresis")}
        return {"scale": self.scale(), **{k: None if v is None else int(v) for k, v in state.items()}}

    def skipped(self) -> bool:
        """The step just recorded was skipped by DeepSpeed (non-finite gradients)."""
        return not bool(self.engine.was_step_applied())

    def meta(self) -> dict:
        engine, opt, scaler = self.engine, self.engine.optimizer, self._scaler()
        fp16 = bool(engine.fp16_enabled())
        dtype = "fp16" if fp16 else "bf16" if engine.bfloat16_enabled() else "fp32"
        config = getattr(opt, "loss_scale_config", None)       # ZeRO 0's FP16_UnfusedOptimizer

        def read(name: str, *objs):
            for obj in objs:
                value = getattr(obj, name, None) if obj is not None else None
                if value is not None:
                    return value
            return None
        dynamic = read("dynamic_loss_scale", opt, config)
        if dynamic is None and scaler is not None:
            dynamic = getattr(scaler, "dynamic", None)
        min_scale = read("min_scale", scaler)
        if min_scale is None:
            min_scale = read("min_loss_scale", opt, config)
        hysteresis = read("delayed_shift", scaler)
        window = read("scale_window", scaler, opt, config)
        factor = read("scale_factor", scaler, config)
        consecutive = read("consecutive_hysteresis", scaler)
        # a DynamicLossScaler raises at the minimum by default; ZeRO 0's fp16 optimizers stay at the minimum
        raises = read("raise_error_at_min_scale", scaler) if hysteresis is not None else (False if dynamic else None)
        import deepspeed
        return {"deepspeed": {
            "version": deepspeed.__version__, "stage": self.stage, "dtype": dtype,
            "optimizer": type(opt).__name__,
            "weights": "full" if self.stage == 0 else "partition",
            "gradient_accumulation_steps": int(engine.gradient_accumulation_steps()),
            "dynamic_loss_scale": None if dynamic is None else bool(dynamic),
            "min_loss_scale": None if min_scale is None else float(min_scale),
            # ZeRO 0's FP16_UnfusedOptimizer backs off on every overflow: no hysteresis
            "hysteresis": None if hysteresis is None else int(hysteresis),
            "scale_window": None if window is None else int(window),
            "scale_factor": None if factor is None else float(factor),
            "consecutive_hysteresis": None if consecutive is None else bool(consecutive),
            "raise_error_at_min_scale": None if raises is None else bool(raises),
            # the scale and the scaler's counters when the recording began (a replay starts from there)
            "init_scale": self.start.get("scale"),
            "scaler_start": {k: v for k, v in self.start.items() if k != "scale"},
            "skipped_steps": int(engine.skipped_steps)}}


def _warn_unreadable(source: _Engine, error: Exception) -> None:
    import deepspeed

    from .._warnings import warn
    warn(f"Recorder: could not read the ZeRO {source.stage} gradient partitions of deepspeed {deepspeed.__version__} "
         f"({type(error).__name__}: {error}); weight gradients are not recorded from here on (activations, loss, "
         f"scale and skipped steps still are). ampviz.integrations.deepspeed is tested with deepspeed 0.19.8.")


class _StepWatch:
    """``engine.optimizer.step`` wrapped on the instance: counts the weight gradients, then steps. ``remove()`` puts
    back what was there, if it is still ours."""

    def __init__(self, source: _Engine, capture: Any) -> None:
        self.optimizer = opt = source.engine.optimizer
        self.before = vars(opt).get("step")
        original = opt.step
        self.installed = self.reading = True

        def step(*args: Any, **kwargs: Any) -> Any:
            if self.installed:
                source.stepped += 1
                try:
                    capture.count_weights_from(source.parts() if self.reading else ())     # () still counts the step
                except Exception as e:                  # never let reading DeepSpeed's internals stop training
                    self.reading = False
                    _warn_unreadable(source, e)
            return original(*args, **kwargs)
        self.wrapper = step
        opt.step = step

    def remove(self) -> None:
        if vars(self.optimizer).get("step") is self.wrapper:
            if self.before is None:
                del self.optimizer.step
            else:
                self.optimizer.step = self.before
        self.installed = False

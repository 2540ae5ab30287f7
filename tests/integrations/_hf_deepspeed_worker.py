"""A transformers ``Trainer`` with ``TrainingArguments(deepspeed=<config>)`` on 2 CPU ranks over gloo
(``DS_ACCELERATOR=cpu``), each case (``CASES``: ZeRO stage, bf16 or fp16) trained twice on the same data: once with
``AmpvizCallback`` and once without. The oracle: ``DeepSpeedEngine.step`` is wrapped at class level (both runs) to
take, at every gradient-accumulation boundary before the engine steps, the histograms of the full gradients DeepSpeed
assembles itself (``safe_get_full_grad``; fp16: divided by the scale the backward used), and after it,
``was_step_applied()``, ``skipped_steps`` and the loss scale. A case may plant an inf loss on rank 0 in the first
micro-batch of optimizer step ``inf_at``, which DeepSpeed skips. Run by
tests/integrations/test_transformers_deepspeed.py through torch.multiprocessing.spawn; one spawn runs every case
given."""

import faulthandler
import json
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import ampviz.histogram as H  # noqa: E402

STEPS, ACCUM, BATCH, INF_AT = 4, 2, 4, 1
GPT2 = dict(vocab_size=48, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)


def model():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**GPT2))                    # random weights: nothing is downloaded


def dataset(n=64):
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, GPT2["vocab_size"], (12,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


DS_CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "train_batch_size": "auto", "gradient_clipping": "auto",
             "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
             "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
# the planted-overflow ZeRO 2 bf16 case the docs describe; ZeRO 3 bf16 (every parameter partitioned); ZeRO 2 fp16 with
# DeepSpeed's dynamic loss scaler from 2**8 (grows after 2 clean steps, hysteresis 2: the planted overflow at step 1
# only uses up the hysteresis)
CASES = {"zero2_bf16": {"name": "hf_ds", "stage": 2, "dtype": "bf16", "inf_at": INF_AT},
         "zero3_bf16": {"name": "hf_ds_zero3", "stage": 3, "dtype": "bf16", "inf_at": None,
                        "zero": {"stage3_param_persistence_threshold": 0}},
         "zero2_fp16": {"name": "hf_ds_fp16", "stage": 2, "dtype": "fp16", "inf_at": INF_AT,
                        "fp16": {"initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 2,
                                 "min_loss_scale": 1}}}


def ds_config(case: dict) -> dict:
    dtype = case["dtype"]
    out = {k: v for k, v in DS_CONFIG.items() if k not in ("bf16", "zero_optimization")}
    out[dtype] = {"enabled": True, **case.get("fp16", {})}
    out["zero_optimization"] = {"stage": case["stage"], **case.get("zero", {})}
    return out


def _scale(engine) -> float:
    opt = engine.optimizer
    return float(getattr(opt, "cur_scale", getattr(opt, "loss_scale", 1.0)))


class _Watch:
    """The oracle: ``DeepSpeedEngine.step`` wrapped at class level."""

    def __init__(self):
        from deepspeed.runtime.engine import DeepSpeedEngine
        self.cls, self.original = DeepSpeedEngine, DeepSpeedEngine.step
        self.oracle, self.applied, self.skipped, self.used, self.scales = [], [], [], [], []
        watch = self

        def step(engine, *args, **kwargs):
            from deepspeed.utils import safe_get_full_grad
            boundary = engine.is_gradient_accumulation_boundary()
            if boundary:
                scale = _scale(engine)                                                # what the backward used
                full = [safe_get_full_grad(p) for p in engine.module.parameters()]   # collective: every rank
                watch.oracle.append([H.histogram(t.float() / scale).numpy() for t in full])
                watch.used.append(scale)
            out = watch.original(engine, *args, **kwargs)
            if boundary:
                watch.applied.append(bool(engine.was_step_applied()))
                watch.skipped.append(int(engine.skipped_steps))
                watch.scales.append(_scale(engine))
            return out
        DeepSpeedEngine.step = step

    def remove(self):
        self.cls.step = self.original


def train(case, rank, out_dir, record):
    from transformers import Trainer, TrainingArguments

    from ampviz.integrations.transformers import AmpvizCallback

    class Planted(Trainer):
        micro = 0

        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            if rank == 0 and case["inf_at"] is not None and self.micro == case["inf_at"] * ACCUM:
                loss = loss * float("inf")                       # a planted overflow on one rank
            self.micro += 1
            return loss

    args = TrainingArguments(output_dir=os.path.join(out_dir, "out"), max_steps=STEPS,
                             per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM,
                             learning_rate=1e-2, bf16=case["dtype"] == "bf16", fp16=case["dtype"] == "fp16",
                             use_cpu=True, deepspeed=ds_config(case), report_to="none",
                             save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
                             dataloader_num_workers=0)
    callback = AmpvizCallback(path=os.path.join(out_dir, case["name"]), activations=True) if record else None
    watch = _Watch()
    trainer = Planted(model=model(), args=args, train_dataset=dataset(), callbacks=[callback] if record else [])
    try:
        trainer.train()
    finally:
        watch.remove()
    engine = trainer.model_wrapped
    weights = [p.float() for p in _full_params(engine)]
    out = {"oracle": np.asarray(watch.oracle), "applied": watch.applied, "skipped": watch.skipped,
           "used": watch.used, "scales": watch.scales,
           "weights": weights, "names": [n for n, _ in engine.module.named_parameters()],
           "stage": int(engine.zero_optimization_stage()), "bf16": bool(engine.bfloat16_enabled()),
           "fp16": bool(engine.fp16_enabled()), "optimizer": type(engine.optimizer).__name__,
           "numels": [int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters()],
           "logged": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    if record:
        out["found_engine"] = callback.engine is engine and callback.engine is trainer.deepspeed
    engine.destroy()
    return out


def _full_params(engine):
    """Every parameter in full (ZeRO 3: gathered from the ranks' partitions), detached copies."""
    params = list(engine.module.parameters())
    if engine.zero_optimization_stage() == 3:
        import deepspeed
        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().clone() for p in params]
    return [p.detach().clone() for p in params]


def run(rank, world, port, out_dir, cases=("zero2_bf16",)):
    faulthandler.enable(all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), ACCELERATE_USE_DEEPSPEED="true")
    import deepspeed
    deepspeed.init_distributed("gloo")
    try:
        for key in cases:
            case = CASES[key]
            plain = train(case, rank, out_dir, record=False)
            recorded = train(case, rank, out_dir, record=True)
            same = all(torch.equal(a, b) for a, b in zip(plain["weights"], recorded["weights"]))
            np.save(os.path.join(out_dir, f"{case['name']}.oracle{rank}.npy"), recorded["oracle"])
            with open(os.path.join(out_dir, f"{case['name']}.rank{rank}.json"), "w") as f:
                json.dump({"bit_identical": same, "found_engine": recorded["found_engine"],
                           **{k: recorded[k] for k in ("applied", "skipped", "used", "scales", "names", "numels",
                                                       "stage", "bf16", "fp16", "optimizer", "logged")},
                           "plain": {k: plain[k] for k in ("applied", "skipped", "scales", "logged")}}, f)
        torch.distributed.barrier()
        code = 0
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

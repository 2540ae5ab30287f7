"""DeepSpeed engines on 2 CPU ranks over gloo (``DS_ACCELERATOR=cpu``), each trained twice on the same data: once
recorded by ``ampviz.integrations.deepspeed.Recorder`` and once not; with an oracle, the histograms of the full
gradients that DeepSpeed itself assembles (``safe_get_full_grad``, an all-reduce per parameter) at the same point
(after the boundary micro-batch's backward, before ``engine.step()``). Run by tests/integrations/test_deepspeed.py
through torch.multiprocessing.spawn; one spawn runs every case given (DeepSpeed's start-up is paid once)."""

import faulthandler
import json
import os
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ampviz.histogram as H  # noqa: E402

STEPS, ACCUM, BATCH = 4, 2, 4


def model():
    torch.manual_seed(0)
    # 12*33 + 33 + 33*5 + 5 = 599 parameters: an odd total, so the partitions split a weight and the last is padded
    return nn.Sequential(nn.Linear(12, 33), nn.ReLU(), nn.Linear(33, 5))


def config(case: dict) -> dict:
    dtype = case["dtype"]
    # fp16: DeepSpeed's dynamic loss scaler from 2**8, growing after 2 clean steps; a case may change it ("fp16")
    scaling = {"initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 2, "min_loss_scale": 1,
               **case.get("fp16", {})} if dtype == "fp16" else {}
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": ACCUM,
            "zero_optimization": {"stage": case["stage"], **case.get("zero", {})}, dtype: {"enabled": True, **scaling},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
            **({"data_types": case["data_types"]} if "data_types" in case else {})}


def train(case: dict, rank: int, out_dir: str, record: bool) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from ampviz.integrations.deepspeed import Recorder
    dtype, steps = case["dtype"], case.get("steps", STEPS)
    inf_at = case.get("inf_at", [])
    inf_at = inf_at if isinstance(inf_at, list) else [inf_at]          # the steps with a planted overflow
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=config(case))
    half = torch.bfloat16 if dtype == "bf16" else torch.float16
    g = torch.Generator().manual_seed(100 + rank)                  # each rank its own data
    oracle, scales, applied, skipped, used = [], [], [], [], []
    options = {"activations": True, **case.get("options", {})}
    # a user's LR scheduler, stepped outside the engine after every engine step (a constant factor: the weights are
    # those of the run without it); the Recorder watches it
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0) if case.get("scheduler") else None
    if sched is not None:
        options["scheduler"] = sched
    rec = Recorder(engine, path=os.path.join(out_dir, case["name"]), **options) if record else None
    if rec is not None and case.get("unreadable"):
        def unreadable(p):                             # as if a DeepSpeed release had moved its partitions
            raise AttributeError("planted: no _hp_mapping")
        rec._framework._local = unreadable
    caught = warnings.catch_warnings(record=True)
    seen = caught.__enter__()
    warnings.simplefilter("always")
    if rec is not None:
        rec.__enter__()
    try:
        for step in range(steps):
            for micro in range(ACCUM):
                x, y = torch.randn(BATCH, 12, generator=g).to(half), torch.randint(0, 5, (BATCH,), generator=g)
                loss = F.cross_entropy(engine(x).float(), y)
                if step in inf_at and micro == 0 and rank == 0:
                    loss = loss * float("inf")                    # a planted overflow on one rank
                boundary = engine.is_gradient_accumulation_boundary()
                engine.backward(loss)
                if boundary:
                    scale = float(getattr(engine.optimizer, "cur_scale", getattr(engine.optimizer, "loss_scale", 1)))
                    used.append(scale)                            # the scale this step's backward used
                    full = [safe_get_full_grad(p) for p in engine.module.parameters()]   # collective: every rank
                    oracle.append([H.histogram(t.float() / scale).numpy() for t in full])
                engine.step()
                if sched is not None and boundary:
                    sched.step()                                  # also on a step the engine skipped
                if rec is not None:
                    rec.step(loss)
            scales.append(float(getattr(engine.optimizer, "cur_scale", getattr(engine.optimizer, "loss_scale", 1))))
            applied.append(bool(engine.was_step_applied()))
            skipped.append(int(engine.skipped_steps))
    finally:
        if rec is not None:
            rec.__exit__(None, None, None)
        caught.__exit__(None, None, None)
    restored = "step" not in vars(engine.optimizer)                  # the wrapper is gone after the recording
    weights = [p.detach().float().clone() for p in _full_params(engine)]
    return {"oracle": np.asarray(oracle), "scales": scales, "used": used, "applied": applied, "skipped": skipped,
            "weights": weights, "names": [n for n, _ in engine.module.named_parameters()],
            "optimizer": type(engine.optimizer).__name__, "step_restored": restored,
            "warnings": [str(w.message) for w in seen if "ampviz" in type(w.message).__module__]}


def _full_params(engine):
    if engine.zero_optimization_stage() == 3:
        import deepspeed
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().clone() for p in params]
    return list(engine.module.parameters())


def run(rank, world, port, out_dir, cases):
    faulthandler.enable(all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import deepspeed
    deepspeed.init_distributed("gloo")
    try:
        for case in cases:
            plain = train(case, rank, out_dir, record=False)
            recorded = train(case, rank, out_dir, record=True)
            same = all(torch.equal(a, b) for a, b in zip(plain["weights"], recorded["weights"]))
            np.save(os.path.join(out_dir, f"{case['name']}.oracle{rank}.npy"), recorded["oracle"])
            with open(os.path.join(out_dir, f"{case['name']}.rank{rank}.json"), "w") as f:
                json.dump({"bit_identical": same, "scales": recorded["scales"], "used": recorded["used"],
                           "applied": recorded["applied"],
                           "skipped": recorded["skipped"], "names": recorded["names"],
                           "optimizer": recorded["optimizer"], "step_restored": recorded["step_restored"],
                           "warnings": recorded["warnings"],
                           "plain": {k: plain[k] for k in ("scales", "applied", "skipped")}}, f)
        torch.distributed.barrier()
        code = 0
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)           # no interpreter teardown with gloo threads running (see tests/_ddp_worker.exit_worker)

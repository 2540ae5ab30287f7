"""What the Recorder captures for the doctor (issue 13), against planted faults in real recorded runs:
the backward order of gradients (grad_order), forward outputs (kind "output") and the LR scheduler's steps."""

import warnings
from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampviz
from ampviz import histogram as H
from ampviz._warnings import AmpvizWarning


class _TimesInf(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by inf when ``on``."""

    @staticmethod
    def forward(ctx, x, on):
        ctx.on = on
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad * float("inf") if ctx.on else grad), None


class InfGradient(nn.Module):
    """Placed right after a layer: the gradient w.r.t. that layer's output becomes inf/nan when ``on``."""

    def __init__(self):
        super().__init__()
        self.on = False

    def forward(self, x):
        return _TimesInf.apply(x, self.on)


def mlp(depth=4, width=24, fault_after=None, seed=0, act=nn.Tanh):
    """fc0, act0, ..., head; an InfGradient after fc{fault_after}."""
    torch.manual_seed(seed)
    layers, d = OrderedDict(), 10
    for i in range(depth):
        layers[f"fc{i}"] = nn.Linear(d, width)
        if i == fault_after:
            layers["fault"] = InfGradient()
        layers[f"act{i}"] = act()
        d = width
    layers["head"] = nn.Linear(d, 3)
    return nn.Sequential(layers)


def data(n, seed=1, bs=16):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(bs, 10, generator=g), torch.randint(0, 3, (bs,), generator=g)) for _ in range(n)]


def amp_loop(model, opt, scaler, batches, rec=None, accum=1, before_backward=None):
    for i in range(0, len(batches), accum):
        for j, (x, y) in enumerate(batches[i:i + accum]):
            if before_backward:
                before_backward(i // accum, j)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y) / accum
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if rec is not None:
            rec.step(loss)


def nonfinite(counts):
    return counts[..., H.ABOVE] + counts[..., H.NAN] > 0


# ------------------------------------------------------------------------------------------ grad_order
@pytest.mark.parametrize("k", [0, 2])
def test_the_first_non_finite_gradient_in_backward_order_is_the_faulty_layer(k):
    model = mlp(fault_after=k)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    fault = model.fault

    def plant(step, micro):
        fault.on = step == 3
    with ampviz.Recorder(model, opt, scaler=scaler) as rec:
        amp_loop(model, opt, scaler, data(6), rec, before_backward=plant)
    run = rec.run
    assert run.grad_order.shape == (1, 6, len(run.tensor_names)) and run.grad_order.dtype == np.int32
    assert run.skipped[0].tolist() == [False, False, False, True, False, False]
    bad = np.flatnonzero(nonfinite(run.counts[0, 3]))
    first = bad[np.argmin(run.grad_order[0, 3, bad])]
    assert run.tensor_names[first] == f"fc{k}" and run.tensor_kinds[first] == "activation"
    # it spread to every layer below it (farther from the loss), never to those above
    assert set(run.tensor_names[t] for t in bad) >= {f"fc{i}" for i in range(k + 1)} | {f"fc{k}.weight"}
    assert not any(run.tensor_names[t] in {f"fc{i}" for i in range(k + 1, 4)} | {"head"} for t in bad)
    assert not nonfinite(run.counts[0, [0, 1, 2, 4, 5]]).any()


def test_grad_order_is_the_backward_order_of_the_steps_first_backward(tmp_path):
    torch.manual_seed(0)

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.side, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)
            self.use_side = False

        def forward(self, x):
            h = self.b(torch.tanh(self.a(x)))
            if self.use_side:
                h = h + self.side(h)
            return self.head(h)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with ampviz.Recorder(model, opt) as rec:
        for _ in range(3):
            for micro in range(2):                 # the side branch runs in the second micro-batch only
                model.use_side = micro == 1
                x, y = torch.randn(4, 6, generator=g), torch.randint(0, 2, (4,), generator=g)
                F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            rec.step()
    run = rec.run
    order = dict(zip(run.tensor_names, run.grad_order[0, 0].tolist()))
    # activation gradients come in backward order: the head's output first, then b, then a
    assert order["head"] == 0 and order["head"] < order["b"] < order["a"]
    assert order["b"] < order["b.weight"] and order["a"] < order["a.weight"]     # a layer's input grad, then its weight
    # the side branch was counted (second backward) but had no place in the first backward
    side = run.tensor_names.index("side")
    assert run.counts[0, :, side].sum() > 0 and run.grad_order[0, :, side].tolist() == [-1] * 3
    assert order["side.weight"] == -1
    seen = sorted(v for v in order.values() if v >= 0)
    assert seen == list(range(len(seen)))                                      # one place per tensor, no gaps
    saved = ampviz.Run.load(run.save(tmp_path / "run.npz")[0])
    np.testing.assert_array_equal(saved.grad_order, run.grad_order)


# --------------------------------------------------------------------------------------------- outputs
def overflowing_mlp(k):
    model = mlp(act=nn.Sigmoid)
    with torch.no_grad():                                # fp16 weights, but their sum over 24 positive inputs
        getattr(model, f"fc{k}").weight.fill_(1e4)       # (sigmoids of the layer before) exceeds 65504
    return model


def test_a_layer_that_overflows_fp16_in_the_forward_shows_inf_in_its_output_row():
    k = 2
    model = overflowing_mlp(k)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    batches = data(3)
    with ampviz.Recorder(model, opt, scaler=scaler, outputs=True) as rec:
        amp_loop(model, opt, scaler, batches, rec)
    run = rec.run
    rows = run.tensors_of("output")
    names = [run.tensor_names[i] for i in rows]
    assert names == [f"fc{i} [output]" for i in range(4)] + ["head [output]"]
    assert run.meta["domains"]["output"] == "unscaled" and {run.tensor_dtypes[i] for i in rows} == {"torch.float16"}
    bad = nonfinite(run.counts[0][:, rows])                     # (steps, output rows)
    assert bad[:, k].all() and run.counts[0][:, rows[k], H.ABOVE].sum() > 0      # inf, in fc2's own outputs
    assert not bad[:, :k].any()                                                    # and in none before it
    # sigmoid(inf) = 1: the loss, the gradients and the scaler never see it; only the output row does
    assert not bad[:, k + 1:].any() and not run.skipped.any() and np.isfinite(run.loss).all()
    # the counts are those of the outputs themselves, as a plain forward computes them
    fresh = overflowing_mlp(k)
    with torch.autocast("cpu", dtype=torch.float16):
        h = batches[0][0]
        for i in range(4):
            h = getattr(fresh, f"fc{i}")(h)
            np.testing.assert_array_equal(run.counts[0, 0, rows[i]], H.histogram(h).numpy())
            h = getattr(fresh, f"act{i}")(h)


def test_outputs_are_counted_in_training_forwards_only_and_follow_the_selection():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(5, 10)
    with ampviz.Recorder(model, opt, activations=False, outputs=["fc1", "head"]) as rec:
        with torch.no_grad():
            model(x)                                              # evaluation: not counted
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        rec.step()
    run = rec.run
    assert run.tensor_names[-2:] == ["fc1 [output]", "head [output]"]
    assert run.counts[0, 0, -2].sum() == 5 * 24 and run.counts[0, 0, -1].sum() == 5 * 3
    with pytest.raises(ValueError, match="outputs: the filter 'nothing' matches nothing"):
        ampviz.Recorder(model, opt, outputs="nothing")


def test_a_module_returning_a_dict_or_tuple_is_recorded_from_its_first_tensor():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return {"hidden": self.lin(x), "aux": x.sum()}
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(block=Block()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    with ampviz.Recorder(model, opt, activations=["block"], outputs=["block"]) as rec:
        out = model(x)["hidden"]
        out.pow(2).sum().backward()
        opt.step()
        rec.step()
    run = rec.run
    expected = H.histogram(2 * out.detach()).numpy()                 # d(sum h^2)/dh
    np.testing.assert_array_equal(run.counts[0, 0, run.tensor_names.index("block")], expected)
    np.testing.assert_array_equal(run.counts[0, 0, run.tensor_names.index("block [output]")],
                                  H.histogram(out.detach()).numpy())


def test_training_is_bit_identical_with_outputs_recorded():
    batches = data(12)
    finals = []
    for record in (False, True):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=2)
        if record:
            with ampviz.Recorder(model, opt, scaler=scaler, outputs=True) as rec:
                amp_loop(model, opt, scaler, batches, rec, accum=2)
            assert rec.run.counts[0, :, rec.run.tensor_kinds.index("output")].sum() > 0
        else:
            amp_loop(model, opt, scaler, batches, accum=2)
        finals.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale()))
    assert finals[0][1] == finals[1][1]
    assert all(torch.equal(a, b) for a, b in zip(finals[0][0], finals[1][0]))


# ------------------------------------------------------------------------------------------- scheduler
def test_scheduler_steps_are_last_epoch_after_each_step_skipped_or_not():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40, growth_interval=1000)     # skips at first
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    seen = []
    with ampviz.Recorder(model, opt, scaler=scaler, scheduler=sched) as rec:
        for x, y in data(30):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            with warnings.catch_warnings():        # torch: "lr_scheduler.step() before optimizer.step()"
                warnings.simplefilter("ignore")
                sched.step()                       # steps on skipped steps too (Lightning's behaviour)
            opt.zero_grad(set_to_none=True)
            rec.step(loss)
            seen.append(sched.last_epoch)
    run = rec.run
    assert run.scheduler_steps.shape == (1, 30) and run.scheduler_steps.dtype == np.int64
    assert run.scheduler_steps[0].tolist() == seen == list(range(1, 31))
    assert run.skipped[0].sum() >= 5
    no_sched = ampviz.Recorder(model, opt)
    with no_sched:
        pass
    assert no_sched.run.scheduler_steps is None


def test_scheduler_argument_is_checked_and_accelerates_wrapper_unwrapped():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(TypeError, match="scheduler: expected a torch.optim.lr_scheduler.LRScheduler .* got str"):
        ampviz.Recorder(model, opt, scheduler="cosine")
    with pytest.raises(TypeError, match="got SGD"):
        ampviz.Recorder(model, opt, scheduler=opt)
    from accelerate.scheduler import AcceleratedScheduler
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)
    rec = ampviz.Recorder(model, opt, scheduler=AcceleratedScheduler(sched, opt))
    assert rec.scheduler is sched
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    assert ampviz.Recorder(model, opt, scheduler=plateau).scheduler is plateau


def test_explicit_out_proj_is_replaced_by_the_attention_output_with_a_warning():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    with pytest.warns(AmpvizWarning, match="never calls its out_proj"):
        rec = ampviz.Recorder(layer, outputs=["self_attn.out_proj"], activations=False)
    assert rec.tensor_names[-1] == "self_attn [output]"
    assert isinstance(layer.self_attn, nn.MultiheadAttention)


class Checkpointed(nn.Module):
    """fc0 and fc1 inside torch.utils.checkpoint (reentrant, as older HF code still does), then head."""

    def __init__(self, reentrant: bool):
        super().__init__()
        torch.manual_seed(0)
        self.fc0, self.fc1, self.head = nn.Linear(10, 24), nn.Linear(24, 24), nn.Linear(24, 3)
        self.reentrant = reentrant

    def block(self, x):
        return torch.tanh(self.fc1(torch.tanh(self.fc0(x))))

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [True, False])
def test_outputs_inside_a_checkpoint_are_counted_once_per_forward(reentrant):
    """A reentrant checkpoint runs the real forward under no_grad and recomputes it inside backward: its
    outputs were lost (issue 17, item 3). Counted once, as the plain forward computes them."""
    model = Checkpointed(reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = data(3)
    x0 = batches[0][0].requires_grad_(reentrant)          # reentrant checkpoint needs an input that requires grad
    with ampviz.Recorder(model, opt, outputs=True) as rec:
        for i, (x, y) in enumerate(batches):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x0 if i == 0 else x.requires_grad_(reentrant)), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec.step(loss)
        with torch.no_grad():
            model(x0)                                     # evaluation: still not counted
    run = rec.run
    fresh = Checkpointed(reentrant)
    with torch.autocast("cpu", dtype=torch.float16):
        h0 = fresh.fc0(batches[0][0])
    np.testing.assert_array_equal(run.histogram(0, "fc0 [output]"), H.histogram(h0).numpy())
    for kind in ("output", "activation"):                 # outputs once; output gradients once (the recomputation's)
        rows = run.tensors_of(kind)
        assert (run.counts[0][:, rows].sum(axis=-1) == [[16 * 24, 16 * 24, 16 * 3]] * 3).all(), kind
        assert run.tensor_dtypes[rows[0]] == "torch.float16"


def test_zero_grad_without_set_to_none_keeps_a_skipped_steps_inf_and_nan():
    """``opt.zero_grad(set_to_none=False)`` before ``rec.step()`` zeroes ``.grad`` in place: a skipped step's
    inf/nan weight gradients were recorded as zeros (issue 17, item 4). They are counted when scaler.step()
    returns, as set_to_none=True records them."""
    runs = {}
    for set_to_none in (True, False):
        model = mlp(fault_after=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        with ampviz.Recorder(model, opt, scaler=scaler) as rec:
            for step, (x, y) in enumerate(data(4)):
                model.fault.on = step == 2
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
                if step == 2:
                    oracle = {n: H.histogram(p.grad.float() / scaler.get_scale()).numpy()
                              for n, p in model.named_parameters()}
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=set_to_none)
                rec.step(loss)
        runs[set_to_none] = rec.run
    assert runs[False].skipped[0].tolist() == [False, False, True, False]
    np.testing.assert_array_equal(runs[False].counts, runs[True].counts)
    for name, expected in oracle.items():
        np.testing.assert_array_equal(runs[False].histogram(2, name), expected)
    assert nonfinite(runs[False].counts[0, 2, runs[False].tensor_index("fc0.weight")])


def test_weight_dtypes_are_those_the_parameters_have_when_the_run_is_built():
    """``model.to(torch.float64)`` after ``Recorder(...)``: the weight rows said float32 (issue 17, item 7)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rec = ampviz.Recorder(model, opt)
    model.to(torch.float64)                               # in place: the same parameters, now float64
    with rec:
        for x, y in data(2):
            F.cross_entropy(model(x.double()), y).backward()
            opt.step()
            opt.zero_grad()
            rec.step()
    run = rec.run
    assert {run.tensor_dtypes[t] for t in run.tensors_of("weight")} == {"torch.float64"}
    assert {run.tensor_dtypes[t] for t in run.tensors_of("activation")} == {"torch.float64"}

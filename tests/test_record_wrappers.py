"""The Recorder with what frameworks hand it (issue 10, defects 3-5): optimizer wrappers (accelerate,
Lightning), a failure while entering, ``optimizer.step(closure)`` (LBFGS, SAM), and misuse that used to
record the wrong thing silently."""

import warnings
from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim.optimizer as optim_module

import ampviz
from ampviz import histogram as H
from ampviz._warnings import AmpvizWarning
from ampviz.doctor import diagnose


def tiny(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(g, n=8):
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def hooks_left(model, opt=None):
    fwd = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    acc = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    step = len(getattr(opt, "_optimizer_step_pre_hooks", {})) if opt is not None else 0
    return fwd + acc + step + len(optim_module._global_optimizer_pre_hooks)


# ------------------------------------------------------------------------------------ defect 3
def test_accelerates_prepared_optimizer_is_unwrapped_and_records_its_gradients():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    try:
        accelerator = Accelerator(cpu=True)
        model, opt = tiny(), None
        model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert type(opt).__name__ == "AcceleratedOptimizer"
        g, direct = torch.Generator().manual_seed(0), []
        with ampviz.Recorder(model, opt, activations=False) as rec:
            assert rec.optimizer is opt.optimizer
            for _ in range(3):
                x, y = batch(g)
                accelerator.backward(F.cross_entropy(model(x), y))
                direct.append([H.histogram(p.grad).numpy() for p in model.parameters()])
                opt.step()
                opt.zero_grad()
                rec.step()
        assert hooks_left(model, opt.optimizer) == 0
        np.testing.assert_array_equal(rec.run.counts[0], np.array(direct))
    finally:
        AcceleratorState._reset_state(True)


def test_lightnings_optimizer_wrapper_is_unwrapped():
    from lightning.pytorch.core.optimizer import LightningOptimizer
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert ampviz.Recorder(model, LightningOptimizer(opt)).optimizer is opt


def test_an_optimizer_subclass_that_skipped_init_is_refused_with_the_fix():
    class Wrapper(torch.optim.Optimizer):              # how AcceleratedOptimizer is built: no super().__init__
        def __init__(self, inner):
            self.inner = inner
    model = tiny()
    with pytest.raises(TypeError, match="Wrapper subclasses torch.optim.Optimizer but never ran Optimizer.__init__"):
        ampviz.Recorder(model, Wrapper(torch.optim.SGD(model.parameters(), lr=0.1)))


def test_a_failure_while_entering_removes_every_hook_installed_so_far():
    class Refuses(nn.Linear):
        def register_forward_hook(self, *args, **kwargs):
            raise RuntimeError("planted: this module refuses hooks")
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(a=nn.Linear(4, 4), b=nn.Linear(4, 4), c=Refuses(4, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = ampviz.Recorder(model, opt, path=None)
    with pytest.raises(RuntimeError, match="planted"):
        with rec:
            pass                                         # never reached
    assert hooks_left(model, opt) == 0
    ok = ampviz.Recorder(model, opt, activations=["a", "b"])
    with ok:
        assert hooks_left(model, opt) > 0
    assert hooks_left(model, opt) == 0


# ------------------------------------------------------------------------------------ defect 4
def test_lbfgs_closure_gradients_are_read_after_the_closure_ran():
    model = tiny()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    g = torch.Generator().manual_seed(0)
    data = [batch(g) for _ in range(3)]
    direct = []
    with ampviz.Recorder(model, opt, activations=False) as rec:
        for x, y in data:
            first = []

            def closure(x=x, y=y, first=first):
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                if not first:                            # the gradient at this step's weights
                    first.append([H.histogram(p.grad).numpy() for p in model.parameters()])
                return loss
            opt.step(closure)
            direct.append(first[0])
            rec.step()
    counts = rec.run.counts[0]
    assert counts[0].sum() > 0                           # step 0 used to be empty
    np.testing.assert_array_equal(counts, np.array(direct))


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as usually written: step(closure) climbs to w + rho * g / |g|, lets the
    closure recompute the gradient there, comes back and applies the base optimizer with that gradient."""

    def __init__(self, params, base, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base = base(self.param_groups, **kwargs)

    @torch.no_grad()
    def step(self, closure):
        norm = torch.norm(torch.stack([p.grad.norm() for g in self.param_groups for p in g["params"]]))
        for group in self.param_groups:
            for p in group["params"]:
                e = p.grad * (group["rho"] / (norm + 1e-12))
                p.add_(e)
                self.state[p]["e"] = e
        with torch.enable_grad():
            closure()
        for group in self.param_groups:
            for p in group["params"]:
                p.sub_(self.state[p]["e"])
        self.base.step()


def test_sam_records_the_gradient_it_applies_computed_by_its_closure():
    model = tiny()
    opt = SAM(model.parameters(), torch.optim.SGD, lr=0.1)
    g = torch.Generator().manual_seed(0)
    direct = []
    with ampviz.Recorder(model, opt, activations=False) as rec:
        for _ in range(3):
            x, y = batch(g)
            F.cross_entropy(model(x), y).backward()            # the gradient that chooses the climb
            seen = []

            def closure(x=x, y=y, seen=seen):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                seen.append([H.histogram(p.grad).numpy() for p in model.parameters()])
            opt.step(closure)
            opt.zero_grad()
            direct.append(seen[0])
            rec.step()
    np.testing.assert_array_equal(rec.run.counts[0], np.array(direct))


# ------------------------------------------------------------------------------------ defect 5
def fp16_step(model, opt, scaler, g):
    x, y = batch(g)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    return loss


def test_step_before_scaler_update_warns():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with ampviz.Recorder(model, opt, scaler=scaler) as rec:
        loss = fp16_step(model, opt, scaler, g)
        scaler.step(opt)
        with pytest.warns(AmpvizWarning, match=r"before scaler.update\(\)"):
            rec.step(loss)
        scaler.update()
        opt.zero_grad()


def test_step_once_per_micro_batch_warns():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with ampviz.Recorder(model, opt, scaler=scaler) as rec:
        loss = fp16_step(model, opt, scaler, g)
        with pytest.warns(AmpvizWarning, match="no optimizer step since the previous call"):
            rec.step(loss)                                     # after the first micro-batch: too early
        loss = fp16_step(model, opt, scaler, g)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        rec.step(loss)


def test_a_correct_loop_with_skipped_steps_gives_no_warning():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)           # the first steps are skipped
    g = torch.Generator().manual_seed(0)
    with ampviz.Recorder(model, opt, scaler=scaler) as rec:
        for _ in range(3):
            for _ in range(2):
                loss = fp16_step(model, opt, scaler, g)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            rec.step(loss)
    assert rec.run.skipped[0].any()


def test_a_gradscaler_the_loop_never_uses_is_said_to_be_unused_at_the_first_step():
    """The Recorder given a second GradScaler (scale 8) while the loop steps with another (2**30 down to
    2**27): it recorded 8 at every step, no skip, and its only warning blamed micro-batches (issue 17, item 5)."""
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    real = torch.amp.GradScaler("cpu", init_scale=2.0 ** 30)
    unused = torch.amp.GradScaler("cpu", init_scale=8.0)
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ampviz.Recorder(model, opt, scaler=unused) as rec:
            for _ in range(6):
                loss = fp16_step(model, opt, real, g)
                real.step(opt)
                real.update()
                opt.zero_grad()
                rec.step(loss)
    said = [str(w.message) for w in caught if issubclass(w.category, AmpvizWarning)]
    assert len(said) == 1 and "this GradScaler's step() was never called" in said[0], said
    assert "its scale stays 8" in said[0] and "micro-batch" not in said[0]
    assert real.get_scale() < 2.0 ** 30                  # the real scaler did skip steps
    assert vars(unused).get("step") is None               # its step() is the class's again


def test_a_saved_run_says_its_gradscaler_never_stepped_and_the_doctor_reads_no_scale_from_it(tmp_path):
    """Issue 17, item 5, read from the file: the warning is gone once the run is saved, so the run says how often
    the watched scaler stepped, and the doctor names a bystander's scale instead of judging it."""
    runs = {}
    for name in ("unused", "used"):
        model = tiny()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        real = torch.amp.GradScaler("cpu", init_scale=2.0 ** 30)
        watched = torch.amp.GradScaler("cpu", init_scale=8.0) if name == "unused" else real
        g = torch.Generator().manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AmpvizWarning)
            with ampviz.Recorder(model, opt, scaler=watched, path=tmp_path / f"{name}.npz") as rec:
                for _ in range(6):
                    loss = fp16_step(model, opt, real, g)
                    real.step(opt)
                    real.update()
                    opt.zero_grad()
                    rec.step(loss)
        runs[name] = ampviz.Run.load(tmp_path / f"{name}.npz")
    assert runs["unused"].meta["scaler"]["steps_called"] == 0
    assert runs["used"].meta["scaler"]["steps_called"] == 6
    bad, good = (diagnose(runs[n]) for n in ("unused", "used"))
    assert [f["check"] for f in bad["findings"]] == ["scaler_unused"]          # not a verdict on the constant 8
    assert "never stepped in 6 recorded steps" in bad["findings"][0]["summary"]
    health = next(c for c in bad["checks"] if c["check"] == "loss-scale health")
    assert not health["ran"] and "never stepped" in health["why"]
    assert "scaler_unused" not in [f["check"] for f in good["findings"]]
    # 2**30 overflows every step of this short run, every value inf: no evidence blames the model
    assert "nonfinite_gradient" not in [f["check"] for f in good["findings"]]


def test_the_gradscalers_step_is_put_back_on_close_also_when_the_loop_raises():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    mine = scaler.step                                    # the user's own instance attribute stays theirs
    scaler.step = mine
    with pytest.raises(RuntimeError, match="boom"):
        with ampviz.Recorder(model, opt, scaler=scaler):
            assert scaler.step is not mine
            raise RuntimeError("boom")
    assert vars(scaler)["step"] is mine


def test_never_calling_step_warns_at_close():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    rec = ampviz.Recorder(model, opt)
    with pytest.warns(AmpvizWarning, match="after 3 optimizer steps without a rec.step"):
        with rec:
            for _ in range(3):
                x, y = batch(g)
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    assert rec.run.n_steps == 0


def test_a_layer_replaced_or_added_after_the_recorder_was_made_is_an_error():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = ampviz.Recorder(model, opt)
    model[2] = nn.Linear(16, 3)                                 # replaced
    with pytest.raises(RuntimeError, match=r"parameter '2.weight' was replaced.*module '2' was replaced"):
        rec.__enter__()
    assert hooks_left(model, opt) == 0
    rec = ampviz.Recorder(model, opt)
    model.append(nn.Linear(3, 3))                              # added
    with pytest.raises(RuntimeError, match=r"parameter '3.weight' was added.*module '3' was added"):
        rec.__enter__()
    rec = ampviz.Recorder(model, opt)
    with pytest.warns(AmpvizWarning, match="changed after `with recorder:` began"):
        with rec:
            model[0] = nn.Linear(6, 16)                         # replaced inside the block
            x, y = batch(torch.Generator().manual_seed(0))
            F.cross_entropy(model(x), y).backward()
            opt.step()
            rec.step()


def test_frozen_modules_are_not_chosen_by_default():
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(embed=nn.Embedding(10, 8), body=nn.Linear(8, 8), head=nn.Linear(8, 2)))
    model.embed.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with ampviz.Recorder(model, opt) as rec:
        F.cross_entropy(model(torch.randint(0, 10, (4, 3))).mean(1), torch.randint(0, 2, (4,))).backward()
        opt.step()
        rec.step()
    run = rec.run
    assert run.tensor_names == ["body.weight", "body.bias", "head.weight", "head.bias", "body", "head"]
    assert (run.counts[0, 0].sum(axis=-1) > 0).all()                  # every row filled
    with pytest.raises(ValueError, match=r"weights: \['embed.weight'\] do not require grad"):
        ampviz.Recorder(model, opt, weights=["embed.weight"])
    assert ampviz.Recorder(model, opt, weights="weight", activations=False).tensor_names == ["body.weight",
                                                                                             "head.weight"]
    with pytest.raises(ValueError, match="matches only frozen parameters"):
        ampviz.Recorder(model, opt, weights="embed")


def test_multihead_attention_is_recorded_in_place_of_its_out_proj():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    expected = []

    def oracle(module, inputs, out):
        out[0].register_hook(lambda g: expected.append(H.histogram(g).numpy()))
    layer.self_attn.register_forward_hook(oracle)
    with ampviz.Recorder(layer, opt) as rec:
        layer(torch.randn(2, 5, 8)).sum().backward()
        opt.step()
        rec.step()
    run = rec.run
    names = [n for n, k in zip(run.tensor_names, run.tensor_kinds) if k == "activation"]
    assert "self_attn" in names and "self_attn.out_proj" not in names
    np.testing.assert_array_equal(run.counts[0, 0, run.tensor_names.index("self_attn")], expected[0])
    assert (run.counts[0, 0].sum(axis=-1) > 0).all()


def test_a_module_returning_a_model_output_is_recorded():
    from transformers.modeling_outputs import BaseModelOutput

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return BaseModelOutput(last_hidden_state=self.lin(x))
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(enc=Encoder()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampviz.Recorder(model, opt, activations=["enc"]) as rec:
        model(torch.randn(3, 4)).last_hidden_state.sum().backward()
        opt.step()
        rec.step()
    assert rec.run.counts[0, 0, -1].tolist() == H.histogram(torch.ones(3, 4)).tolist()

"""The Recorder on a torch.compile'd model (issue 10, defect 2): no graph breaks added, the same final
weights as the compiled run without it, names without ``_orig_mod``, activation capture off with a warning
(or refused when asked for explicitly), never a silent change to training."""

import shutil
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampviz
from ampviz._warnings import AmpvizWarning
from ampviz.run import KINDS

# inductor compiles C++ on the CPU (about 40 s the first time)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                                                   reason="torch.compile's inductor needs a C++ compiler")]


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))


def train_compiled(record: bool, backend="inductor", **options):
    """(final weights, Dynamo's graph-break counters, the recorder) of 4 compiled bf16 AdamW steps."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = build()
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    rec = ampviz.Recorder(compiled, opt, enabled=record, **options)
    with rec:
        for _ in range(4):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(compiled(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec.step(loss)
    breaks = sum(counters["graph_break"].values())
    return [p.detach().clone() for p in model.parameters()], breaks, rec


def test_compiled_training_is_unchanged_and_activations_are_switched_off_with_a_warning():
    base, base_breaks, _ = train_compiled(False)
    with pytest.warns(AmpvizWarning, match="runs under torch.compile.*activations are not recorded"):
        weights, breaks, rec = train_compiled(True)
    assert breaks == base_breaks == 0
    assert all(torch.equal(a, b) for a, b in zip(base, weights))
    run = rec.run
    assert run.tensor_names == ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]
    assert (run.counts[0].sum(axis=-1) == [[p.numel() for p in build().parameters()]] * 4).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                     # activations=False: said so, no warning
        weights, breaks, _ = train_compiled(True, activations=False)
    assert breaks == 0 and all(torch.equal(a, b) for a, b in zip(base, weights))


def test_asking_for_activations_of_a_compiled_model_is_an_error():
    compiled = torch.compile(build())
    with pytest.raises(ValueError, match=r"activations: 2 chosen modules run inside torch.compile \(0, 3\)"):
        ampviz.Recorder(compiled, activations=["0", "3"])
    with pytest.raises(ValueError, match="outputs: .* run inside torch.compile"):
        ampviz.Recorder(compiled, activations=False, outputs=True)


def test_compiled_by_applies_the_compile_rules_to_a_model_compiled_out_of_sight_and_names_the_setting():
    # a framework that compiles a wrapper the Recorder never sees (HF's torch_compile=True) hands it the plain model
    model = build()
    with pytest.warns(AmpvizWarning, match=r"^Trainer\(compile=1\): the model runs under torch.compile.*not recorded "
                                           r"for 3 modules"):
        rec = ampviz.Recorder(model, compiled_by="Trainer(compile=1)")
    assert rec.tensor_kinds == ["weight"] * 6
    with pytest.raises(ValueError, match=r"^activations='3' with Trainer\(compile=1\): 1 chosen modules run inside"):
        ampviz.Recorder(model, activations="3", compiled_by="Trainer(compile=1)")
    with pytest.raises(ValueError, match=r"^outputs=True with Trainer\(compile=1\)"):
        ampviz.Recorder(model, activations=False, outputs=True, compiled_by="Trainer(compile=1)")
    with pytest.raises(TypeError, match="compiled_by: .* got True"):
        ampviz.Recorder(model, compiled_by=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(ampviz.Recorder(model).tensor_names) == 9     # without it: 6 weights, 3 activations


def test_a_compiled_block_keeps_its_name_and_the_rest_is_recorded():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2))
    model[2] = torch.compile(model[2], backend="aot_eager")
    with pytest.warns(AmpvizWarning, match="not recorded for 1 modules"):
        rec = ampviz.Recorder(model)
    assert rec.tensor_names == ["0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias", "0", "3"]


def train_compiled_out_of_sight(record: bool, how: str, backend="inductor", outputs=False):
    """As train_compiled, but the Recorder gets the plain module while the loop calls ``torch.compile(model)``
    ("wrapper"), or the model is compiled in place after the Recorder was made ("after")."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = build()
    called = torch.compile(model, backend=backend) if how == "wrapper" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    rec = ampviz.Recorder(model, opt, enabled=record, outputs=outputs)
    if how == "after":
        model.compile(backend=backend)
    with rec:
        for _ in range(4):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(called(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec.step(loss)
    breaks = sum(counters["graph_break"].values())
    return [p.detach().clone() for p in model.parameters()], breaks, rec


@pytest.mark.parametrize("how", ["wrapper", "after"])
def test_hooks_traced_by_a_compile_the_recorder_was_not_told_about_stand_down_and_say_so(how):
    """Recorder(m) while the loop calls torch.compile(m), or m compiled after Recorder(m): the module hooks ran
    inside the compiled graph, graph breaks went from 0 to 7 and the final weights changed (issue 17, item 6).
    They stand down (no graph break, the same weights) and the first rec.step() says so."""
    base, base_breaks, _ = train_compiled_out_of_sight(False, how)
    said = {"wrapper": r"ran under torch.compile without the Recorder being given the compiled model.*stood down",
            # compiled in place before `with rec:` is seen there: no hook goes on (even one doing nothing changes
            # how torch.compile splits an in-place compiled module's graph)
            "after": r"the model was compiled after Recorder\(...\) was made, so 3 watched modules"}[how]
    with pytest.warns(AmpvizWarning, match=said) as caught:
        weights, breaks, rec = train_compiled_out_of_sight(True, how, outputs=True)
    assert len([w for w in caught if issubclass(w.category, AmpvizWarning)]) == 1
    assert breaks == base_breaks == 0
    assert all(torch.equal(a, b) for a, b in zip(base, weights))
    run = rec.run
    weights_rows = run.tensors_of("weight")
    others = run.tensors_of(sorted(set(KINDS) - {"weight"}))
    assert (run.counts[0][:, weights_rows].sum(axis=-1) == [p.numel() for p in build().parameters()]).all()
    assert run.counts[0][:, others].sum() == 0               # nothing counted inside the graph
    forward = next(c for c in run.diagnose()["checks"] if c["check"].startswith("forward overflow"))
    assert forward["check"] == "forward overflow (loss only)" and "3 of its 3 rows never filled" in forward["why"]

"""RecordOptions: every Recorder option checked once and frozen, passed whole, written into the run's metadata."""

import dataclasses
import json

import numpy as np
import pytest
import torch

import ampviz
from ampviz.record import Recorder, RecordOptions
from ampviz.run import KIND_DOMAIN, KINDS


def tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def record(rec, model, optimizer, steps=3):
    with rec:
        for _ in range(steps):
            loss = model(torch.randn(5, 4)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            rec.step(loss)
    return rec.run


def test_options_are_frozen_and_the_recorder_uses_the_ones_given():
    model, optimizer = tiny()
    options = RecordOptions(every=2, activations=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.every = 3
    rec = Recorder(model, optimizer, options=options, weights=r"\.weight$")
    assert rec.options.every == 2 and rec.options.weights == r"\.weight$" and options.weights is True
    assert rec.every == 2 and rec.tensor_kinds == ["weight", "weight"]
    assert ampviz.RecordOptions is RecordOptions and ampviz.Recorder is Recorder


@pytest.mark.parametrize("kw, error, text", [
    ({"every": 0}, ValueError, "every"),
    ({"flush_every": 1.5}, ValueError, "flush_every: expected an integer >= 1"),
    ({"save_every": -1}, ValueError, "save_every: expected a positive number of seconds"),
    ({"compiled_by": ""}, TypeError, "compiled_by: expected the setting"),
    ({"activations": 3}, TypeError, "activations: expected True, False, a regex string"),
    ({"weights": "("}, ValueError, "weights: invalid regular expression"),
    ({"path": "run.txt"}, ValueError, "path: 'run.txt' ends in '.txt'"),
    ({"scheduler": object()}, TypeError, "scheduler: expected a torch.optim.lr_scheduler.LRScheduler"),
])
def test_options_give_the_recorders_messages_without_a_model(kw, error, text):
    with pytest.raises(error, match=text.replace("(", r"\(").replace(".", r"\.")):
        RecordOptions(**kw)
    model, optimizer = tiny()
    with pytest.raises(error, match=text.replace("(", r"\(").replace(".", r"\.")):
        Recorder(model, optimizer, **kw)


def test_an_unknown_option_names_the_valid_ones():
    model, optimizer = tiny()
    with pytest.raises(TypeError, match=r"unknown Recorder option\(s\) \['evry'\]; valid: \['weights'"):
        Recorder(model, optimizer, evry=2)


def test_the_run_says_how_it_was_recorded_and_files_without_it_still_load(tmp_path):
    model, optimizer = tiny()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    rec = Recorder(model, optimizer, weights=lambda name, p: True, activations=["0", "2"], scheduler=scheduler,
                   every=2, path=tmp_path / "run.npz", save_every=None)
    run = record(rec, model, optimizer)
    options = run.meta["options"]
    assert options == {"weights": "test_the_run_says_how_it_was_recorded_and_files_without_it_still_load.<locals>"
                                  ".<lambda>",
                       "activations": ["0", "2"], "outputs": False, "local_weights": False, "scheduler": "StepLR",
                       "every": 2, "flush_every": 32, "max_bytes": 256 << 20, "path": str(tmp_path / "run.npz"),
                       "save_every": None, "save_every_steps": None, "enabled": True, "compiled_by": None,
                       "updates": 0, "blocks": False}
    json.dumps(options)
    assert run.meta["domains"] == KIND_DOMAIN and tuple(KIND_DOMAIN) == KINDS     # the schema, stated once
    assert ampviz.Run.load(tmp_path / "run.npz").meta["options"] == options
    old = dataclasses.replace(run, meta={k: v for k, v in run.meta.items() if k != "options"})
    old.save(tmp_path / "old.npz")
    loaded = ampviz.Run.load(tmp_path / "old.npz")
    assert "options" not in loaded.meta and np.array_equal(loaded.counts, run.counts)

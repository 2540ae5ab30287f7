"""The Recorder's warnings point at the user's line (the first frame outside ampviz), wherever inside ampviz they
are raised: a decimation deep in the store's flush, a misuse check, a warning at close, one in Recorder(...)."""

import inspect
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampviz
from ampviz import histogram as H
from ampviz._warnings import AmpvizWarning


def tiny(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def backward(model, g):
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss


def here() -> int:
    """The line after the caller's."""
    return inspect.currentframe().f_back.f_lineno + 1


def ampviz_warnings(caught):
    return [w for w in caught if issubclass(w.category, AmpvizWarning)]


def test_a_decimation_warning_points_at_the_users_rec_step_line():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with ampviz.Recorder(model, opt, max_bytes=4 * 8 * H.NBINS * 8, flush_every=1) as rec:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(6):
                loss = backward(model, g)
                opt.step()
                opt.zero_grad()
                line = here()
                rec.step(loss)                                  # the ring (one row) flushes here and decimates
    found = [w for w in ampviz_warnings(caught) if "max_bytes" in str(w.message)]
    assert found and rec.run.meta["decimated"] == len(found) >= 1
    assert {(w.filename, w.lineno) for w in found} == {(__file__, line)}
    assert rec.every == rec.run.meta["every"] == 2 ** len(found)


def test_a_decimation_at_rec_run_points_at_that_line():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    rows = 6                                                    # 4 weights + 2 activations
    row_bytes = rows * (H.NBINS * 8 + 4) + 8
    rec = ampviz.Recorder(model, opt, max_bytes=32 * row_bytes)   # 32 rows on the host, a ring of 2
    assert len(rec.tensor_names) == rows
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rec:
            for _ in range(33):                                 # 32 rows fill the host, the 33rd waits in the ring
                loss = backward(model, g)
                opt.step()
                opt.zero_grad()
                rec.step(loss)
            line = here()
            run = rec.run                                       # its flush decimates
    found = [w for w in ampviz_warnings(caught) if "max_bytes" in str(w.message)]
    assert run.meta["decimated"] == len(found) == 1
    assert [(w.filename, w.lineno) for w in found] == [(__file__, line)]


def test_a_misuse_warning_points_at_the_users_rec_step_line():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with ampviz.Recorder(model, opt) as rec:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backward(model, g)
            line = here()
            rec.step()                                          # a micro-batch: no optimizer step since the last
            backward(model, g)
            opt.step()
            opt.zero_grad()
            rec.step()
    found = [w for w in ampviz_warnings(caught) if "no optimizer step" in str(w.message)]
    assert [(w.filename, w.lineno) for w in found] == [(__file__, line)]


def test_warnings_at_close_and_in_recorder_construction_point_at_the_users_lines():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = here()
        with ampviz.Recorder(model, opt):                       # closed without a rec.step(): a warning
            backward(model, torch.Generator().manual_seed(0))
            opt.step()
    found = [w for w in ampviz_warnings(caught) if "without a rec.step()" in str(w.message)]
    assert [(w.filename, w.lineno) for w in found] == [(__file__, line)]

    attention = nn.Sequential(nn.MultiheadAttention(8, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = here()
        ampviz.Recorder(attention, activations=["0.out_proj"])
    found = [w for w in ampviz_warnings(caught) if "never calls its out_proj" in str(w.message)]
    assert [(w.filename, w.lineno) for w in found] == [(__file__, line)]


def test_warn_skips_every_ampviz_frame():
    from ampviz._warnings import warn

    ns = {"__name__": "ampviz.fake", "warn": warn}                # two functions of "ampviz", nested
    exec("def deep():\n    warn('deep')\ndef middle():\n    deep()\n", ns)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = here()
        ns["middle"]()
    assert [(w.filename, w.lineno, str(w.message)) for w in caught] == [(__file__, line, "deep")]

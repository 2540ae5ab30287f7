"""Recorder(..., blocks=...): the block statistics of each nn.Linear's input, weight and output gradient, held
against ampviz.blocks.block_counts on the same tensors grabbed by hooks of the test's own; bit-identical training;
hooks gone on close (also when entering fails); the period; files (round trip, older files, hostile ones); the
option's errors; the docs' example."""

import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampviz
from ampviz.blocks import LAYOUTS, BlockCounts, block_counts, what_if
from ampviz.run import RunFileError

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("input", "weight", "grad_output")


class Block(nn.Module):
    """Pre-norm MLP block with a residual: LayerNorm, Linear(32, 64), GELU, Dropout, Linear(64, 32)."""

    def __init__(self, d=32, hidden=64):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)
        self.drop = nn.Dropout(0.1)                  # training consumes the RNG: a recorder that did would show

    def forward(self, x):
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 10)                # 10 outputs: its output gradient fills a partial block

    def forward(self, x):                            # x: (batch, seq, 32)
        return self.head(self.norm(self.blocks(x)))


LINEARS = ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down", "head"]


def net(seed=0):
    torch.manual_seed(seed)
    return Net()


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 8, 32, generator=g), torch.randint(0, 10, (2, 8), generator=g)) for _ in range(n)]


def train(model, opt, data, rec=None, autocast=False, micro=1):
    """A plain loop; ``micro`` micro-batches (halves of the batch) per optimizer step."""
    for x, y in data:
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = F.cross_entropy(model(xs).float().flatten(0, 1), ys.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rec is not None:
            rec.step(loss)


class Grab:
    """The oracle's tensors: per step, per Linear, the inputs, the weight and the output gradients, copied by
    hooks of the test's own, as the bf16 GEMM receives them under autocast."""

    def __init__(self, model, autocast):
        self.autocast, self.step, self.seen = autocast, 0, {}
        self.handles = [m.register_forward_hook(self.forward_hook(n)) for n, m in model.named_modules()
                        if n in LINEARS]

    def put(self, name, kind, t):
        self.seen.setdefault((self.step, name, kind), []).append(t.detach().clone())

    def forward_hook(self, name):
        def hook(module, inputs, output):
            gemm = (lambda t: t.to(torch.bfloat16)) if self.autocast else (lambda t: t)
            self.put(name, "input", gemm(inputs[0]))
            if (self.step, name, "weight") not in self.seen:          # once per step
                self.put(name, "weight", gemm(module.weight))
            output.register_hook(lambda g: self.put(name, "grad_output", g))
        return hook

    def expected(self, step, name, kind, layout) -> BlockCounts:
        parts = [block_counts(t, layout, dim=-1, pad=True) for t in self.seen[(step, name, kind)]]
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return total


@pytest.mark.parametrize("autocast, micro, counter", [(False, 1, ""), (True, 1, ""), (True, 2, ""),
                                                     (True, 1, "torch")])
def test_counts_equal_block_counts_of_the_tensors_grabbed_by_hand(autocast, micro, counter, monkeypatch):
    """``counter="torch"``: block_counts' torch ops (what a GPU runs: index_add_, no host sync) instead of numba."""
    monkeypatch.setenv("AMPVIZ_COUNTER", counter)
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    grab = Grab(model, autocast)
    rec = ampviz.Recorder(model, opt, activations=False, blocks={"every": 2})
    with rec:
        for step, batch in enumerate(batches(5)):
            grab.step = step
            train(model, opt, [batch], rec, autocast, micro)
    run = rec.run
    blocks = run.blocks
    assert blocks.steps.tolist() == [0, 2, 4] and blocks.every == 2
    assert blocks.modules == [n for n in LINEARS for _ in KINDS] and blocks.kinds == list(KINDS) * len(LINEARS)
    assert [x.name for x in blocks.layouts] == list(LAYOUTS)
    assert blocks.counts.shape == (1, 3, 3 * len(LINEARS), len(LAYOUTS), blocks.counts.shape[-1])
    for step in (0, 2, 4):
        for name in LINEARS:
            for kind in KINDS:
                assert len(grab.seen[(step, name, kind)]) == (1 if kind == "weight" else micro)
                for layout in LAYOUTS:
                    got, want = run.block_counts(name, kind, layout, step=step), grab.expected(step, name, kind, layout)
                    assert torch.equal(got.counts, want.counts), (step, name, kind, layout)
                    np.testing.assert_allclose(got.sumsq.numpy(), want.sumsq.numpy(), rtol=1e-12)
                    assert got.layout == want.layout
    # summed over the recorded steps, and over a list of them
    total = run.block_counts("head", "grad_output", "mx32")
    assert torch.equal(total.counts, sum(grab.expected(s, "head", "grad_output", "mx32").counts for s in (0, 2, 4)))
    two = run.block_counts("head", "input", "nv16", step=[0, 4], rank=0)
    assert torch.equal(two.counts, sum(grab.expected(s, "head", "input", "nv16").counts for s in (0, 4)))
    assert what_if(total, "mxfp8_e5m2").exact                     # what a user does with it


def snapshot(model, opt):
    return [p.detach().clone() for p in model.parameters()] + [v.clone() for s in opt.state.values()
                                                               for v in s.values() if torch.is_tensor(v)]


def test_bit_identical_training_with_the_block_capture():
    finals = []
    for blocks in (None, False, 1, 3):
        for autocast in (False, True):
            model = net()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            torch.manual_seed(5)                                   # dropout's masks
            threads = torch.get_num_threads()
            if blocks is None:
                train(model, opt, batches(6), autocast=autocast, micro=2)
            else:
                with (rec := ampviz.Recorder(model, opt, blocks=blocks)):
                    train(model, opt, batches(6), rec, autocast=autocast, micro=2)
            assert torch.get_num_threads() == threads
            finals.append((snapshot(model, opt), torch.rand(4)))   # the RNG's state afterwards too
    for k in range(2):                                              # fp32, then bf16 autocast
        base, rng = finals[k]
        for other, other_rng in finals[2 + k::2]:
            assert len(other) == len(base) and all(torch.equal(a, b) for a, b in zip(base, other))
            assert torch.equal(rng, other_rng)


def linear_hooks(model):
    return sum(len(m._forward_hooks) for m in model.modules() if isinstance(m, nn.Linear))


def test_the_hooks_go_on_close_and_blocks_true_means_every_100_steps():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = ampviz.Recorder(model, opt, activations=False, blocks=True)
    assert rec.options.blocks.every == 100 and [x.name for x in rec.options.blocks.layouts] == list(LAYOUTS)
    assert ampviz.RecordOptions(blocks=False).blocks is None and ampviz.RecordOptions(blocks=0).blocks is None
    with rec:
        assert linear_hooks(model) == len(LINEARS)
        train(model, opt, batches(3), rec)
    assert linear_hooks(model) == 0
    assert rec.run.blocks.steps.tolist() == [0]
    assert rec.run.meta["options"]["blocks"] == {"every": 100, "layouts": list(LAYOUTS), "modules": True}


def test_the_block_hooks_are_removed_when_entering_fails(monkeypatch):
    from ampviz.record import _blocks
    install = _blocks.BlockCapture.install

    def install_then_fail(self, handles, skip=frozenset()):
        install(self, handles, skip)
        raise RuntimeError("planted")
    monkeypatch.setattr(_blocks.BlockCapture, "install", install_then_fail)
    model = net()
    rec = ampviz.Recorder(model, torch.optim.SGD(model.parameters(), lr=0.1), blocks=1)
    with pytest.raises(RuntimeError, match="planted"):
        with rec:
            pass
    assert linear_hooks(model) == 0


def test_the_period_modules_and_layouts_chosen_are_respected_and_no_grad_forwards_are_not_counted():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = ampviz.Recorder(model, opt, activations=False,
                          blocks={"every": 3, "layouts": "row", "modules": r"^blocks\.1\."})
    with rec:
        for batch in batches(7):
            with torch.no_grad():
                model(batch[0])                                    # evaluation: not counted
            train(model, opt, [batch], rec)
    blocks = rec.run.blocks
    assert blocks.steps.tolist() == [0, 3, 6]
    assert list(dict.fromkeys(blocks.modules)) == ["blocks.1.up", "blocks.1.down"]
    assert [x.name for x in blocks.layouts] == ["row"]
    c = rec.run.block_counts("blocks.1.up", "input", "row", step=3)
    assert int(c.d.sum() + c.zero) == 2 * 8 * 32                 # one forward's input, not two
    with pytest.raises(KeyError, match=r"step: 4 has no block statistics \(counted every 3 steps"):
        rec.run.block_counts("blocks.1.up", "input", "row", step=4)
    with pytest.raises(KeyError, match="layout: 'mx32' was not recorded; recorded: row"):
        rec.run.block_counts("blocks.1.up", "input", "mx32")
    with pytest.raises(KeyError, match="module: no block statistics of 'head'"):
        rec.run.block_counts("head", "input", "row")
    with pytest.raises(ValueError, match="kind: expected one of input, weight, grad_output"):
        rec.run.block_counts("blocks.1.up", "bias", "row")


# ------------------------------------------------------------------ files
def record(tmp_path=None, steps=5, **kw):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = ampviz.Recorder(model, opt, activations=False, **kw)
    with rec:
        train(model, opt, batches(steps), rec)
    return rec.run


def same_blocks(a, b):
    assert a.steps.tolist() == b.steps.tolist() and a.meta() == b.meta()
    np.testing.assert_array_equal(a.counts, b.counts)
    np.testing.assert_array_equal(a.sumsq, b.sumsq)


def test_round_trip_through_periodic_saves_whole_files_and_ranks(tmp_path):
    run = record(steps=9, blocks={"every": 2, "layouts": ["mx32", "nv16"]}, path=tmp_path / "r.npz",
                 save_every_steps=2)
    with zipfile.ZipFile(tmp_path / "r.npz") as z:
        assert "block_counts.1.npy" in z.namelist()                # appended in parts
    for loaded in (ampviz.Run.load(tmp_path / "r.npz"), ampviz.Run.load(run.save(tmp_path / "whole.npz")[0])):
        same_blocks(loaded.blocks, run.blocks)
        assert "blocks" not in loaded.meta                        # it lives in run.blocks
        assert torch.equal(loaded.block_counts("head", "weight", "nv16").counts,
                           run.block_counts("head", "weight", "nv16").counts)
    other = ampviz.Run.load(run.save(tmp_path / "whole.npz")[0])
    other.meta["ranks"] = [1]
    two = ampviz.Run.merge([run, other])
    assert two.blocks.counts.shape[0] == 2
    both = two.block_counts("head", "input", "mx32")
    assert torch.equal(both.counts, 2 * run.block_counts("head", "input", "mx32").counts)
    assert torch.equal(two.block_counts("head", "input", "mx32", rank=1).counts,
                       run.block_counts("head", "input", "mx32").counts)
    two.save(tmp_path / "dir")
    same_blocks(ampviz.Run.load(tmp_path / "dir").blocks, two.blocks)
    same_blocks(two.select(rank=1).blocks, run.blocks)


def test_a_run_without_blocks_loads_as_before(tmp_path):
    run = record(path=tmp_path / "old.npz")
    with zipfile.ZipFile(tmp_path / "old.npz") as z:
        assert not [n for n in z.namelist() if n.startswith("block")]
    loaded = ampviz.Run.load(tmp_path / "old.npz")
    assert loaded.blocks is None and run.blocks is None and "blocks" not in loaded.meta
    with pytest.raises(ValueError, match=r"blocks: this run has no block statistics \(record with"):
        loaded.block_counts("head", "input", "mx32")


def test_an_older_loader_reads_a_file_with_blocks_without_them(tmp_path):
    """What an ampviz before blocks= did: it reads only the members it knows, and keeps unknown metadata."""
    path = record(blocks=1).save(tmp_path / "new.npz")[0]
    from ampviz.run import _file
    known = {k: v for k, v in _file.DTYPES.items() if not k.startswith("block_")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_file, "DTYPES", known)
        with zipfile.ZipFile(path) as z:
            _, parts = _file.members(path, z)
        assert not [n for n in parts if n.startswith("block")]


def _rewrite(src, dst, change):
    with zipfile.ZipFile(src) as z:
        arrays = {n[:-4]: np.load(z.open(n)) for n in z.namelist()}
    change(arrays)
    with open(dst, "wb") as f:
        np.savez(f, **arrays)
    return dst


def _meta(change):
    def edit(arrays):
        import json
        meta = json.loads(str(arrays["meta"][()]))
        change(meta["blocks"])
        arrays["meta"] = np.array(json.dumps(meta))
    return edit


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update({"block_counts": a["block_counts"] - 5}), r"block_counts: negative count"),
    (lambda a: a.pop("block_sumsq"), r"block_sumsq: missing while other block statistics are present"),
    (lambda a: a.update({"block_steps": a["block_steps"][::-1].copy()}), r"block_steps: not strictly increasing"),
    (lambda a: a.update({"block_steps": a["block_steps"] + 1000}), r"block_steps: step 1000 is not in steps"),
    (lambda a: a.update({"block_counts": a["block_counts"][:, :2]}), r"block_counts has shape"),
    (lambda a: a.update({"block_counts": a["block_counts"].astype(np.float32)}), r"block_counts: expected integer"),
    (lambda a: a.update({"block_sumsq": -a["block_sumsq"] - 1}), r"block_sumsq: expected finite sums of squares"),
    (_meta(lambda b: b.update(kinds=["bias"] * len(b["kinds"]))), r"blocks.kinds: 'bias' is not a block kind"),
    (_meta(lambda b: b.update(layouts=[["mx32", 0, 32]])),
     r"blocks.layouts: \[.mx32., 0, 32\]: block_rows: expected a positive integer"),
    (_meta(lambda b: b.update(every="often")), r"blocks.every: expected an integer >= 1"),
])
def test_hostile_block_arrays_give_one_line(tmp_path, change, message):
    path = _rewrite(record(blocks=2).save(tmp_path / "good.npz")[0], tmp_path / "bad.npz", change)
    with pytest.raises(RunFileError, match=message) as info:
        ampviz.Run.load(path)
    assert "\n" not in str(info.value) and "bad.npz" in str(info.value)


# ------------------------------------------------------------------ the option
@pytest.mark.parametrize("value, message", [
    (-1, r"blocks: expected True \(every 100 steps, layouts mx32, nv16, row, tile1x128, tile128x128\), False, a "
         r"number of steps >= 1, or a dict with any of every, layouts, modules .*, got -1$"),
    (2.5, r"blocks: expected True .*, got 2\.5$"),
    ("often", r"blocks: expected True .*, got 'often'$"),
    ({"every": 0}, r"blocks: every: expected a number of steps >= 1, got 0$"),
    ({"often": 1}, r"blocks: unknown key\(s\) \['often'\] in \{'often': 1\}; valid keys: every, layouts, modules$"),
    ({"layouts": ["mx64"]}, r"blocks: layout: unknown block layout 'mx64'; valid: mx32, nv16, row"),
    ({"layouts": []}, r"blocks: layouts: expected a layout name or a non-empty list"),
    ({"layouts": ["mx32", "mx32"]}, r"blocks: layouts: \['mx32', 'mx32'\] names a layout twice"),
    ({"modules": False}, r"blocks: modules: expected True, a regex.*pass blocks=False"),
])
def test_a_bad_blocks_value_is_named(value, message):
    model = net()
    with pytest.raises(ValueError, match=message):
        ampviz.Recorder(model, torch.optim.SGD(model.parameters(), lr=0.1), blocks=value)


def test_modules_that_match_nothing_or_no_linear_are_said():
    model = net()
    with pytest.raises(ValueError, match=r"blocks: modules: the filter 'nothing' matches nothing"):
        ampviz.Recorder(model, blocks={"modules": "nothing"})
    with pytest.raises(ValueError, match=r"blocks: modules: no such names \['norm'\]"):
        ampviz.Recorder(model, blocks={"modules": ["norm"]})            # a LayerNorm is not a GEMM
    norm = nn.Sequential(nn.LayerNorm(4))
    with pytest.warns(ampviz.AmpvizWarning, match=r"blocks= records nothing here \(the model has no nn.Linear"):
        with ampviz.Recorder(norm, blocks=True):
            pass


# ------------------------------------------------------------------ the docs
def test_the_docs_example_of_recording_blocks_runs():
    text = (ROOT / "docs" / "blocks.md").read_text()
    section = text[text.index("## Recording during training"):]
    block = re.search(r"```python\n(.*?)\n```", section, re.S).group(1)
    namespace = {"__name__": "__doc__"}
    exec(compile(block, "docs/blocks.md: recording during training", "exec"), namespace)
    assert namespace["run"].blocks.steps.tolist() == [0, 10, 20]


def test_blocks_on_a_compiled_model_is_refused_naming_the_modules():
    model = net()
    with pytest.raises(ValueError, match=r"blocks: 5 chosen modules run inside torch.compile \(blocks.0.up, "
                                         r"blocks.0.down, blocks.1.up\); .* or pass blocks=False"):
        ampviz.Recorder(torch.compile(model), activations=False, blocks=True)
    ampviz.Recorder(torch.compile(model), activations=False, blocks=False)          # off: nothing to refuse

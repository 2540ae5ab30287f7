"""Recorder(..., updates=N): the weights' updates against their ulp, held against copies taken by hand; the
doctor's weights_stall on a planted pure-bf16 stall (and not with fp32 master weights); files; bit-identical
training."""

import re
import zipfile

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampviz
from ampviz import histogram as H
from ampviz.doctor import as_text
from ampviz.run import RunFileError


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.fc(x))))


def net(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return Net().to(dtype)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def train(model, opt, data, rec=None, autocast=False, hand=None):
    """A plain loop; ``hand`` collects (step, before, after, grads) copies of every parameter around each step."""
    dtype = next(model.parameters()).dtype
    for step, (x, y) in enumerate(data):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(x.to(dtype)).float(), y)
        loss.backward()
        if hand is not None:
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        if hand is not None:
            hand.append((step, before, {n: p.detach().clone() for n, p in model.named_parameters()}, grads))
        opt.zero_grad(set_to_none=True)
        if rec is not None:
            rec.step(loss)


def record(model, opt, data, autocast=False, hand=None, **kw):
    rec = ampviz.Recorder(model, opt, activations=False, **kw)
    with rec:
        train(model, opt, data, rec, autocast, hand)
    return rec.run


# ------------------------------------------------------------------ the oracle
def columns(v: np.ndarray) -> np.ndarray:
    """Binade column of each float64 value >= 0 (or nan), from numpy.frexp: 2**k < v <= 2**(k+1) -> k + 128."""
    v = np.asarray(v, dtype=np.float64).ravel()
    out = np.empty(v.size, dtype=np.int64)
    m, e = np.frexp(v)
    k = np.where(m == 0.5, e - 2, e - 1)                  # an exact power of two belongs to the binade below
    out[:] = np.clip(k + 128, 1, 255)
    out[v <= 2.0 ** -126] = 1
    out[v == 0] = 0
    out[v > 2.0 ** 127] = 255
    out[np.isnan(v)] = 256
    return out


def spacing(w: torch.Tensor) -> np.ndarray:
    """ulp of each weight in its own dtype, from numpy's spacing (bf16: float32's, with 16 fraction bits fewer)."""
    a = np.abs(w.float().numpy())
    if w.dtype == torch.float16:
        return np.spacing(a.astype(np.float16)).astype(np.float64)
    s = np.spacing(a.astype(np.float32)).astype(np.float64)
    return s * 2.0 ** 16 if w.dtype == torch.bfloat16 else s


def oracle(hand, names):
    steps = [s for s, *_ in hand]
    ulp = np.zeros((len(hand), len(names), H.NBINS), np.int64)
    rel = np.zeros_like(ulp)
    stalled = np.zeros((len(hand), len(names)), np.int64)
    for u, (_, before, after, grads) in enumerate(hand):
        for j, n in enumerate(names):
            w0 = before[n].double().numpy().ravel()
            dw = np.abs(after[n].double().numpy().ravel() - w0)
            ulp[u, j] = np.bincount(columns(dw / spacing(before[n]).ravel()), minlength=H.NBINS)
            with np.errstate(divide="ignore", invalid="ignore"):
                r = np.where((w0 == 0) & (dw == 0), 0.0, dw / np.abs(w0))
            rel[u, j] = np.bincount(columns(r), minlength=H.NBINS)
            stalled[u, j] = int(((dw == 0) & (grads[n].double().numpy().ravel() != 0)).sum())
    return np.array(steps), ulp, rel, stalled


@pytest.mark.parametrize("dtype, make_opt", [
    (torch.bfloat16, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)),
    (torch.float32, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)),
    (torch.float16, lambda m: torch.optim.SGD(m.parameters(), lr=1e-3)),
])
def test_counts_equal_an_oracle_from_copies_taken_by_hand(dtype, make_opt):
    model = net(dtype)
    opt = make_opt(model)
    hand = []
    run = record(model, opt, batches(7), hand=hand, updates=2)
    names = [n for n, _ in model.named_parameters()]
    assert [run.tensor_names[t] for t in run.tensors_of("weight")] == names
    steps, ulp, rel, stalled = oracle([h for h in hand if h[0] % 2 == 0], names)
    assert run.update_steps.tolist() == steps.tolist() == [0, 2, 4, 6]
    np.testing.assert_array_equal(run.update_counts[0], ulp)
    np.testing.assert_array_equal(run.update_rel_counts[0], rel)
    np.testing.assert_array_equal(run.update_stalled[0], stalled)
    assert (run.update_counts.sum(-1)[0] == [p.numel() for p in model.parameters()]).all()


@pytest.mark.parametrize("make_opt", [lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                                      lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)])
def test_bit_identical_training_with_the_update_capture(make_opt):
    """Weights and optimizer state (its copies taken and compared on the steps due) as without the capture."""
    finals = []
    for updates in (False, 1, 3):
        for dtype, autocast in ((torch.bfloat16, False), (torch.float32, True)):
            model = net(dtype)
            opt = make_opt(model)
            if updates is False:
                train(model, opt, batches(6), autocast=autocast)
            else:
                record(model, opt, batches(6), autocast=autocast, updates=updates)
            finals.append([p.detach().clone() for p in model.parameters()] +
                          [v.clone() for s in opt.state.values() for v in s.values()])
    for k in range(2):
        base = finals[k]
        for other in finals[2 + k::2]:
            assert all(torch.equal(a, b) for a, b in zip(base, other))


# ------------------------------------------------------------------ the planted stall
LR = 1e-3     # AdamW's first updates are about lr per element; below half a bf16 ulp of 1.0 (2**-9 below 1.0)


def test_doctor_finds_a_pure_bf16_layernorm_stall_and_not_with_fp32_master_weights():
    assert LR < 2.0 ** -9          # half the gap below 1.0 in bf16 (ulp 2**-8 in [0.5, 1)): every update rounds back
    model = net(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    hand = []
    run = record(model, opt, batches(12), hand=hand, updates=2)
    for _, before, after, grads in hand:          # the plant: non-zero gradients, updates that round away
        assert (grads["norm.weight"] != 0).float().mean() > 0.9
        assert torch.equal(after["norm.weight"], before["norm.weight"])
    assert (model.norm.weight == 1.0).all()
    report = run.diagnose()
    stall = [f for f in report["findings"] if f["check"] == "weights_stall"]
    assert len(stall) == 1, report["findings"]
    f = stall[0]
    assert f["tensors"][0] == "norm.weight" and f["severity"] == "warning"
    nonzero = sum(int((g["norm.weight"] != 0).sum()) for s, _, _, g in hand if s % 2 == 0)
    assert f["evidence"]["tensors"]["norm.weight"]["stalled_share"] == nonzero / (32 * run.update_steps.size)
    assert f["steps"] == run.update_steps.tolist()
    assert "master weights" in f["recommendation"] and "stochastic rounding" in f["recommendation"]
    assert any(c["check"].startswith("weight updates") and c["ran"] for c in report["checks"])
    text = as_text(report, "bf16")
    assert "weights_stall" in text or "stop learning" in text

    master = net(torch.float32)                      # the same model, fp32 weights under bf16 autocast
    opt = torch.optim.AdamW(master.parameters(), lr=LR)
    run = record(master, opt, batches(12), autocast=True, updates=2)
    report = run.diagnose()
    assert not [f for f in report["findings"] if f["check"] == "weights_stall"]
    assert (master.norm.weight != 1.0).any()
    # ... and it answers "can I drop fp32 master weights?": no, the norm's updates would round away in bf16
    would = [f for f in report["findings"] if f["check"] == "bf16_weights_would_stall"]
    assert len(would) == 1 and would[0]["tensors"][0] == "norm.weight" and would[0]["severity"] == "info"
    assert report["updates"]["master_weights"].startswith("drop fp32 master weights (bf16 weights)? no")
    assert report["updates"]["master_weights"] in as_text(report, "master", width=0)
    rows = {r["tensor"]: r for r in report["updates"]["tensors"]}
    assert rows["norm.weight"]["bf16_lost_certain"] == 1.0


def test_a_run_without_updates_has_none_and_the_check_says_why():
    model = net()
    run = record(model, torch.optim.SGD(model.parameters(), lr=0.1), batches(3))
    assert run.update_steps is None and run.update_counts is None
    report = run.diagnose()
    assert report["updates"] is None
    row = next(c for c in report["checks"] if c["check"].startswith("weight updates"))
    assert not row["ran"] and "updates=" in row["why"]


# ------------------------------------------------------------------ files
def test_round_trip_through_periodic_saves_and_whole_files(tmp_path):
    model = net(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    run = record(model, opt, batches(9), updates=2, path=tmp_path / "r.npz", save_every_steps=2)
    with zipfile.ZipFile(tmp_path / "r.npz") as z:
        assert "update_counts.1.npy" in z.namelist()            # appended in parts
    for loaded in (ampviz.Run.load(tmp_path / "r.npz"), ampviz.Run.load(run.save(tmp_path / "whole.npz")[0])):
        for name in ("update_steps", "update_counts", "update_rel_counts", "update_stalled", "state_counts",
                     "state_stalled"):
            np.testing.assert_array_equal(getattr(loaded, name), getattr(run, name))
        assert loaded.state_names == ["exp_avg", "exp_avg_sq"] and run.state_counts[0, 1:].sum() > 0
        assert loaded.meta["options"]["updates"] == 2
    two = ampviz.Run.merge([run, ampviz.Run(**{**_fields(run), "meta": dict(run.meta, ranks=[1])})])
    assert two.update_counts.shape[0] == 2
    two.save(tmp_path / "dir")
    back = ampviz.Run.load(tmp_path / "dir")
    np.testing.assert_array_equal(back.update_stalled, two.update_stalled)
    np.testing.assert_array_equal(back.state_counts, two.state_counts)
    sel = run.select(tensors=["head.weight", "norm.weight"])
    np.testing.assert_array_equal(sel.update_counts[0, :, 1], run.update_counts[0, :, 2])
    np.testing.assert_array_equal(sel.state_stalled[0, :, 1], run.state_stalled[0, :, 2])


def _fields(run):
    return {k: getattr(run, k) for k in ("steps", "loss", "loss_scale", "next_scale", "skipped", "hist_steps",
                                         "counts", "tensor_names", "tensor_kinds", "tensor_dtypes", "grad_order",
                                         "scheduler_steps", "update_steps", "update_counts", "update_rel_counts",
                                         "update_stalled", "state_counts", "state_stalled")}


def test_an_older_file_without_update_arrays_still_loads(tmp_path):
    model = net()
    record(model, torch.optim.SGD(model.parameters(), lr=0.1), batches(3), path=tmp_path / "old.npz")
    with zipfile.ZipFile(tmp_path / "old.npz") as z:
        assert not [n for n in z.namelist() if n.startswith("update")]
    loaded = ampviz.Run.load(tmp_path / "old.npz")
    assert loaded.update_steps is None and loaded.diagnose()["updates"] is None


def _rewrite(src, dst, change):
    with zipfile.ZipFile(src) as z:
        arrays = {n[:-4]: np.load(z.open(n)) for n in z.namelist()}
    change(arrays)
    with open(dst, "wb") as f:
        np.savez(f, **arrays)
    return dst


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update({"update_stalled": a["update_stalled"] - 5}), r"update_stalled: negative count"),
    (lambda a: a.pop("update_rel_counts"), r"update_rel_counts: missing while other update arrays are present"),
    (lambda a: a.update({"update_steps": a["update_steps"][::-1].copy()}), r"update_steps: not strictly increasing"),
    (lambda a: a.update({"update_steps": a["update_steps"] + 1000}), r"update_steps: step 1000 has an update but"),
    (lambda a: a.update({"update_counts": a["update_counts"][:, :2]}), r"update_counts has shape"),
    (lambda a: a.update({"update_counts": a["update_counts"].astype(np.float32)}), r"update_counts: expected integer"),
])
def test_hostile_update_arrays_give_one_line(tmp_path, change, message):
    model = net(torch.bfloat16)
    run = record(model, torch.optim.AdamW(model.parameters(), lr=LR), batches(4), updates=2)
    path = _rewrite(run.save(tmp_path / "good.npz")[0], tmp_path / "bad.npz", change)
    with pytest.raises(RunFileError, match=message) as info:
        ampviz.Run.load(path)
    assert "\n" not in str(info.value) and "bad.npz" in str(info.value)


# ------------------------------------------------------------------ the option
@pytest.mark.parametrize("value", [-1, 2.5, "often", [1]])
def test_a_bad_updates_value_is_named(value):
    model = net()
    with pytest.raises(ValueError, match=r"^updates: expected True \(every 100 steps\), False or a number of steps "
                                         rf">= 1 between update captures, got {re.escape(repr(value))}$"):
        ampviz.Recorder(model, torch.optim.SGD(model.parameters(), lr=0.1), updates=value)


def test_updates_true_means_every_100_steps_and_the_hooks_go_on_close():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = ampviz.Recorder(model, opt, updates=True)
    assert rec.options.updates == 100 and ampviz.RecordOptions(updates=False).updates == 0
    with rec:
        assert opt._optimizer_step_post_hooks
        train(model, opt, batches(2), rec)
    assert not opt._optimizer_step_post_hooks and not opt._optimizer_step_pre_hooks
    assert rec.run.update_steps.tolist() == [0]


@pytest.mark.parametrize("fused", [False, True])
def test_a_step_the_grad_scaler_skipped_has_no_update_row(fused):
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    rec = ampviz.Recorder(model, opt, scaler, activations=False, updates=1)
    with rec:
        for step, (x, y) in enumerate(batches(4)):
            loss = F.cross_entropy(model(x), y) * (float("inf") if step == 1 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            rec.step(loss)
    run = rec.run
    assert run.skipped[0].tolist() == [False, True, False, False]
    sizes = [p.numel() for p in model.parameters()]
    if not fused:                                  # the optimizer never stepped: no row
        assert run.update_steps.tolist() == [0, 2, 3]
        assert (run.update_counts[0].sum(-1) == [sizes] * 3).all()
    else:                                          # its kernel skipped (found_inf): an all-zero row, read on device
        assert run.update_steps.tolist() == [0, 1, 2, 3]
        assert (run.update_counts[0].sum(-1) == [sizes, [0] * len(sizes), sizes, sizes]).all()
        assert (run.update_stalled[0, 1] == 0).all() and (run.update_rel_counts[0, 1] == 0).all()


def test_the_update_hooks_are_removed_when_entering_fails(monkeypatch):
    from ampviz.record import _updates
    install = _updates.UpdateCapture.install

    def install_then_fail(self, optimizer, handles):
        install(self, optimizer, handles)
        raise RuntimeError("planted")
    monkeypatch.setattr(_updates.UpdateCapture, "install", install_then_fail)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = ampviz.Recorder(model, opt, updates=1)
    with pytest.raises(RuntimeError, match="planted"):
        with rec:
            pass
    assert not opt._optimizer_step_post_hooks and not opt._optimizer_step_pre_hooks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_measure_in_pieces_equals_the_oracle_at_the_edges(dtype, monkeypatch):
    """Zeros, subnormals, sign changes, huge jumps, inf and nan after the step, spread over several pieces."""
    from ampviz.record import _updates
    monkeypatch.setattr(_updates, "_CHUNK_CPU", 1000)
    g = torch.Generator().manual_seed(3)
    fi = torch.finfo(dtype)
    w0 = (torch.randn(5000, generator=g) * 2.0 ** torch.randint(-20, 8, (5000,), generator=g)).to(dtype)
    w0[:50] = 0
    w0[50:100] = fi.smallest_normal / 4
    w0[100:150] = fi.max / 2
    w1 = (w0.double() * (1 + 1e-3 * torch.randn(5000, generator=g, dtype=torch.float64))).to(dtype)
    w1[150:200] = -w0[150:200]
    w1[200:220] = float("inf")
    w1[220:240] = float("nan")
    w1[240:300] = w0[240:300]
    w1[:25] = 0
    w1[100:120] = -fi.max
    w1[300:350] = fi.smallest_normal / 8
    grad = torch.randn(5000, generator=g)
    grad[::7] = 0
    rows, stalled = torch.zeros(2, H.NBINS, dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    _updates._measure(w0.reshape(50, 100), w1.reshape(50, 100), grad.reshape(50, 100), rows, stalled)
    _, ulp, rel, want_stalled = oracle([(0, {"w": w0}, {"w": w1}, {"w": grad})], ["w"])
    np.testing.assert_array_equal(rows[0], ulp[0, 0])
    np.testing.assert_array_equal(rows[1], rel[0, 0])
    assert int(stalled) == want_stalled[0, 0] > 0


# ------------------------------------------------------------------ the optimizer state
def train_with_state(model, opt, data, every, rec=None, autocast=False):
    """``train`` keeping, at the steps due, copies of the state before and after, and the state a bf16-stored
    optimizer would have: the same step run from the state rounded to bf16 (a clone of the optimizer)."""
    import copy
    hand = []
    for step, (x, y) in enumerate(data):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        due = step % every == 0 and bool(opt.state)
        if due:
            names = [n for n, _ in model.named_parameters()]
            before = {(n, k): v.clone() for n, p in zip(names, model.parameters())
                      for k, v in opt.state[p].items() if v.shape == p.shape}
            shadow = copy.deepcopy((model, opt))           # the same step, from the state rounded to bf16
            s_model, s_opt = shadow
            for p, sp in zip(model.parameters(), s_model.parameters()):
                sp.grad = p.grad.clone()
            for st in s_opt.state.values():
                for k, v in st.items():
                    if k != "step":
                        v.copy_(v.bfloat16().float())
            s_opt.step()
        opt.step()
        if due:
            after = {(n, k): v.clone() for n, p in zip(names, model.parameters())
                     for k, v in opt.state[p].items() if v.shape == p.shape}
            bf16 = {(n, k): (v.bfloat16() == sb_before) for n, sp in zip(names, s_model.parameters())
                    for k, v in s_opt.state[sp].items() if v.shape == sp.shape
                    for sb_before in [before[(n, k)].bfloat16()]}
            hand.append((step, before, after, bf16))
        opt.zero_grad(set_to_none=True)
        if rec is not None:
            rec.step(loss)
    return hand


def test_state_counts_equal_an_oracle_and_bf16_state_would_stall_as_a_bf16_state_optimizer_does():
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999))
    rec = ampviz.Recorder(model, opt, activations=False, updates=3)
    with rec:
        hand = train_with_state(model, opt, batches(31), 3, rec)
    run = rec.run
    assert run.state_names == ["exp_avg", "exp_avg_sq"]
    names = [n for n, _ in model.named_parameters()]
    assert run.update_steps.tolist() == list(range(0, 31, 3))
    assert (run.state_counts[0, 0] == 0).all()                  # step 0: no state before the step, nothing measured
    direct = np.zeros((len(hand), len(names), 2), np.int64)
    for u, (step, before, after, bf16) in enumerate(hand):
        assert run.update_steps[u + 1] == step
        for j, n in enumerate(names):
            for k, state in enumerate(run.state_names):
                s0, s1 = before[(n, state)].double().numpy().ravel(), after[(n, state)].double().numpy().ravel()
                ds = np.abs(s1 - s0)
                with np.errstate(divide="ignore", invalid="ignore"):
                    rel = np.where(ds == 0, 0.0, ds / np.abs(s0))
                np.testing.assert_array_equal(run.state_counts[0, u + 1, j, k],
                                              np.bincount(columns(rel), minlength=H.NBINS))
                direct[u, j, k] = int((bf16[(n, state)].numpy().ravel() & (ds != 0)).sum())
    recorded = run.state_stalled[0, 1:]
    # the bf16-state optimizer starts from the rounded state: its change differs from the fp32 one by (1 - beta) of
    # a rounding error, which flips an element only at the half-ulp boundary
    changed = run.state_counts[0, 1:, :, :, 1:].sum(-1)
    assert np.abs(recorded - direct).sum() <= 0.002 * changed.sum()
    share = recorded[..., 1].sum() / changed[..., 1].sum()     # exp_avg_sq: beta2 = 0.999, changes ~1e-3 relative
    assert share > 0.1 and share > recorded[..., 0].sum() / changed[..., 0].sum()

    report = run.diagnose()
    found = [f for f in report["findings"] if f["check"] == "bf16_optimizer_state_would_stall"]
    assert len(found) == 1 and found[0]["severity"] == "info"
    f = found[0]
    assert "exp_avg_sq" in f["summary"] and "fp32" in f["recommendation"]
    evidence = f["evidence"]["states"]["exp_avg_sq"]
    assert evidence["stalled_elements"] == recorded[..., 1].sum() and evidence["share"] == pytest.approx(share)
    assert abs(evidence["share"] - direct[..., 1].sum() / changed[..., 1].sum()) < 0.005
    assert f["tensors"] and set(f["tensors"]) <= set(names)
    assert report["updates"]["optimizer_state"]["states"][1]["state"] == "exp_avg_sq"


def test_sgd_without_momentum_has_no_state_arrays_and_no_finding_with_momentum_it_has():
    model = net()
    run = record(model, torch.optim.SGD(model.parameters(), lr=0.1), batches(5), updates=2)
    assert run.state_counts is None and run.state_stalled is None and run.state_names == []
    assert not [f for f in run.diagnose()["findings"] if f["check"] == "bf16_optimizer_state_would_stall"]
    assert run.diagnose()["updates"]["optimizer_state"] is None
    model = net()
    run = record(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), batches(5), updates=2)
    assert run.state_names == ["momentum_buffer"] and run.state_counts.shape == (1, 3, 6, 1, H.NBINS)
    assert run.state_counts[0, 1:].sum() == 2 * sum(p.numel() for p in model.parameters())


def test_a_bf16_weight_run_gets_no_state_finding():
    model = net(torch.bfloat16)
    run = record(model, torch.optim.AdamW(model.parameters(), lr=LR), batches(7), updates=2)
    assert run.state_counts is not None and (run.state_stalled == 0).all()    # bf16 state: it moved or it did not
    assert not [f for f in run.diagnose()["findings"] if f["check"] == "bf16_optimizer_state_would_stall"]

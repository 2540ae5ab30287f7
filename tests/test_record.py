"""The Recorder against directly computed gradients, real GradScaler behaviour, and bit-identical training."""


import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim.optimizer as optim_module

import ampviz
from ampviz import histogram as H
from ampviz._warnings import AmpvizWarning


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))


def batches(n, seed=1, bs=16):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(bs, 12, generator=g), torch.randint(0, 5, (bs,), generator=g)) for _ in range(n)]


def train(model, data, *, dtype=None, scaler=None, accum=1, recorder=None, zero_before_step=True, lr=0.05):
    """A plain loop; returns the loss of each optimizer step. The recorder, if any, only watches."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9) if recorder is None else recorder.optimizer
    losses = []
    for i in range(0, len(data), accum):
        total = 0.0
        for x, y in data[i:i + accum]:
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = F.cross_entropy(model(x), y) / accum
            (scaler.scale(loss) if scaler else loss).backward()
            total += loss.detach()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if zero_before_step:
            opt.zero_grad(set_to_none=True)
        if recorder is not None:
            recorder.step(total)
        if not zero_before_step:
            opt.zero_grad(set_to_none=True)
        losses.append(float(total))
    return losses


class Oracle:
    """Independent capture: clones of every weight gradient before the step and every module-output
    gradient, to compare the recorder's histograms against."""

    def __init__(self, model, opt, names):
        self.model, self.weights, self.acts, self.handles = model, [], [], []
        self.mods = [dict(model.named_modules())[n] for n in names]
        self.handles.append(opt.register_step_pre_hook(self._pre))
        for i, m in enumerate(self.mods):
            self.handles.append(m.register_forward_hook(self._fwd(i)))

    def _fwd(self, i):
        def on_grad(g):
            self.acts[-1][i] = self.acts[-1][i] + H.histogram(g)

        def hook(mod, inp, out):
            out.register_hook(on_grad)     # returns None: the output is not replaced
        return hook

    def new_step(self):
        self.acts.append([torch.zeros(H.NBINS, dtype=torch.int64) for _ in self.mods])
        self.weights.append(None)

    def _pre(self, opt, args, kwargs):
        self.weights[-1] = [H.histogram(p.grad) for p in self.model.parameters()]


def test_histograms_equal_directly_computed_gradients_with_accumulation():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    names = ["0", "2", "4"]
    oracle = Oracle(model, opt, names)
    rec = ampviz.Recorder(model, opt, activations=names)
    data = batches(6)
    with rec:
        for i in range(0, 6, 2):
            oracle.new_step()
            for x, y in data[i:i + 2]:
                (F.cross_entropy(model(x), y) / 2).backward()
            opt.step()
            opt.zero_grad()
            rec.step()
    run = rec.run
    assert run.tensor_names == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias", "0", "2", "4"]
    assert run.tensor_kinds == ["weight"] * 6 + ["activation"] * 3
    for s in range(3):
        for t in range(6):
            np.testing.assert_array_equal(run.counts[0, s, t], oracle.weights[s][t].numpy())
        for a in range(3):
            np.testing.assert_array_equal(run.counts[0, s, 6 + a], oracle.acts[s][a].numpy())
            assert run.counts[0, s, 6 + a].sum() == 2 * 16 * model[int(names[a])].out_features


def test_fp16_gradscaler_weights_unscaled_activations_scaled():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    oracle = Oracle(model, opt, ["2"])
    rec = ampviz.Recorder(model, opt, scaler=scaler, activations=["2"])
    with rec:
        for x, y in batches(5):
            oracle.new_step()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            rec.step(loss)
    run = rec.run
    assert run.meta["domains"] == {"weight": "unscaled", "activation": "scaled", "weight_local": "scaled",
                                   "output": "unscaled"}
    assert run.tensor_dtypes[-1] == "torch.float16" and run.loss_scale[0].tolist() == [1024, 1024, 2048, 2048, 4096]
    for s in range(5):
        np.testing.assert_array_equal(run.counts[0, s, 0], oracle.weights[s][0].numpy())   # after unscale_
        np.testing.assert_array_equal(run.counts[0, s, -1], oracle.acts[s][0].numpy())     # as computed
    # one call away: the activation gradients divided by the loss scale
    log2s = np.log2(run.loss_scale[0]).astype(int)
    unscaled = run.counts_in("unscaled")
    for s in range(5):
        np.testing.assert_array_equal(unscaled[0, s, -1], H.shift(oracle.acts[s][0].numpy(), -log2s[s]))
    assert np.allclose(run.loss[0], [float(v) for v in run.loss[0]]) and np.isfinite(run.loss).all()


def test_skipped_steps_are_detected_and_their_gradients_kept_after_zero_grad():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40, growth_interval=1000)   # overflows at first
    rec = ampviz.Recorder(model, opt, scaler=scaler, activations=False)
    real_skips = []
    with rec:
        for x, y in batches(30):
            before = [p.detach().clone() for p in model.parameters()]
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)      # grads gone before rec.step()
            rec.step(loss)
            real_skips.append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
    run = rec.run
    assert sum(real_skips) >= 10
    assert run.skipped[0].tolist() == real_skips
    first = run.counts[0, 0].sum(axis=0)
    assert first[H.ABOVE] + first[H.NAN] > 0            # the overflowing gradients were recorded
    clean = np.flatnonzero(~run.skipped[0])[0]
    assert run.counts[0, clean, :, [H.ABOVE, H.NAN]].sum() == 0
    assert (run.counts[0].sum(axis=(1, 2)) == sum(p.numel() for p in model.parameters())).all()


def test_recording_never_changes_training_bit_for_bit():
    data = batches(24)
    results = []
    for with_recorder in (False, True, False):
        model = tiny_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 18, growth_interval=3)
        if with_recorder:
            rec = ampviz.Recorder(model, opt, scaler=scaler, activations=True)
            with rec:
                train(model, data, dtype=torch.float16, scaler=scaler, accum=3, recorder=rec)
            assert rec.run.n_steps == 8 and rec.run.skipped.any() and not rec.run.skipped.all()
        else:
            opt_ = opt
            for i in range(0, 24, 3):
                for x, y in data[i:i + 3]:
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss = F.cross_entropy(model(x), y) / 3
                    scaler.scale(loss).backward()
                scaler.step(opt_)
                scaler.update()
                opt_.zero_grad(set_to_none=True)
        results.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale()))
    for (w0, s0), (w1, s1) in [(results[0], results[1]), (results[0], results[2])]:
        assert s0 == s1
        assert all(torch.equal(a, b) for a, b in zip(w0, w1))


def hook_counts(model, opt):
    fwd = sum(len(m._forward_hooks) for m in model.modules())
    acc = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    return fwd, acc, len(opt._optimizer_step_pre_hooks), len(optim_module._global_optimizer_pre_hooks)


def test_hooks_are_removed_on_exit_and_when_the_loop_raises(tmp_path):
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert hook_counts(model, opt) == (0, 0, 0, 0)
    with ampviz.Recorder(model, opt) as rec:
        assert hook_counts(model, opt) == (4, 6, 1, 0)      # 3 watched modules + the model's own (its end)
        train(model, batches(2), recorder=rec)
    assert hook_counts(model, opt) == (0, 0, 0, 0)
    rec2 = ampviz.Recorder(model, None, path=tmp_path / "crash.npz")     # global optimizer hook
    with pytest.raises(RuntimeError, match="boom"):
        with rec2:
            assert hook_counts(model, opt)[3] == 1
            train(model, batches(3), recorder=None)
            for x, y in batches(2):
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                rec2.step()
            raise RuntimeError("boom")
    assert hook_counts(model, opt) == (0, 0, 0, 0)
    saved = ampviz.Run.load(tmp_path / "crash.npz")        # nothing lost: the two steps were saved
    assert saved.n_steps == 2 and saved.counts[0, :, :6].sum() == 2 * sum(p.numel() for p in model.parameters())


def test_every_n_keeps_scalars_for_every_step():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rec = ampviz.Recorder(model, opt, every=3, flush_every=2)
    with rec:
        losses = train(model, batches(10), recorder=rec)
    run = rec.run
    assert run.hist_steps.tolist() == [0, 3, 6, 9] and run.n_steps == 10
    np.testing.assert_allclose(run.loss[0], losses, rtol=1e-6)
    assert run.loss_scale[0].tolist() == [1.0] * 10 and not run.skipped.any()


def test_bf16_without_scaler():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rec = ampviz.Recorder(model, opt)
    with rec:
        train(model, batches(3), dtype=torch.bfloat16, recorder=rec)
    run = rec.run
    assert run.meta["scaler"] is None and run.tensor_dtypes[-1] == "torch.bfloat16"
    assert run.counts[0, :, -1].sum(axis=-1).tolist() == [16 * 5] * 3


def test_memory_is_bounded_by_decimation():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    T = 6 + 3
    row = T * H.NBINS * 8
    rec = ampviz.Recorder(model, opt, flush_every=4, max_bytes=10 * row)
    with pytest.warns(AmpvizWarning, match="max_bytes"):
        with rec:
            train(model, batches(60, bs=4), recorder=rec)
    run = rec.run
    assert run.hist_steps.size <= 10 and run.n_steps == 60 and run.meta["decimated"] >= 2
    assert np.all(run.hist_steps % run.meta["every"] == 0) or run.meta["every"] > 1


def test_enabled_false_is_a_no_op():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = ampviz.Recorder(model, opt, enabled=False)
    with rec:
        assert hook_counts(model, opt) == (0, 0, 0, 0)
        train(model, batches(2), recorder=rec)
    with pytest.raises(RuntimeError, match="enabled=False"):
        _ = rec.run


def test_module_outputs_modified_in_place_still_give_the_output_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    out0 = model[0](x).detach().requires_grad_()
    (model[2](F.relu(out0))).sum().backward()
    expected = H.histogram(out0.grad).numpy()
    model.zero_grad()
    with ampviz.Recorder(model, opt, activations=["0"]) as rec:
        model(x).sum().backward()
        opt.step()
        rec.step()
    np.testing.assert_array_equal(rec.run.counts[0, 0, -1], expected)


def test_bad_inputs_are_named():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module, got dict"):
        ampviz.Recorder({})
    with pytest.raises(TypeError, match="scaler: expected a torch.amp.GradScaler or None, got str"):
        ampviz.Recorder(model, opt, scaler="fp16")
    with pytest.raises(TypeError, match="optimizer: expected a torch.optim.Optimizer"):
        ampviz.Recorder(model, "sgd")
    with pytest.raises(ValueError, match="every: expected an integer >= 1, got 0"):
        ampviz.Recorder(model, opt, every=0)
    with pytest.raises(ValueError, match="activations: the filter 'conv' matches nothing"):
        ampviz.Recorder(model, opt, activations="conv")
    with pytest.raises(ValueError, match="weights: invalid regular expression"):
        ampviz.Recorder(model, opt, weights="(")
    with pytest.raises(ValueError, match=r"activations: no such names \['9'\]"):
        ampviz.Recorder(model, opt, activations=["9"])
    with pytest.raises(TypeError, match="activations: expected True, False, a regex"):
        ampviz.Recorder(model, opt, activations=3)
    rec = ampviz.Recorder(model, opt)
    with pytest.raises(RuntimeError, match="outside `with recorder:`"):
        rec.step()
    with rec:
        with pytest.raises(ValueError, match="loss: expected a scalar"):
            rec.step(torch.ones(3))
    with pytest.raises(RuntimeError, match="closed"):
        rec.__enter__()


def test_ddp_two_ranks_record_rank_world_and_local_vs_reduced(tmp_path):
    import socket

    import _ddp_worker
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker.run, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    run = ampviz.Run.load(tmp_path)
    assert run.ranks == [0, 1] and run.meta["world_size"] == 2
    kinds = np.array(run.tensor_kinds)
    reduced, local = run.counts[:, :, kinds == "weight"], run.counts[:, :, kinds == "weight_local"]
    assert reduced.shape == local.shape and local.sum() > 0
    # after the all-reduce every rank holds the same gradients; before it, ranks differ
    np.testing.assert_array_equal(reduced[0], reduced[1])
    assert not np.array_equal(local[0], local[1])
    np.testing.assert_array_equal(run.skipped[0], run.skipped[1])
    # every local histogram counted each parameter exactly once per step (no_sync on the other micro-batch)
    sizes = [torch.Size(s) for s in ([16, 6], [16], [3, 16], [3])]
    assert (local.sum(axis=-1) == np.array([s.numel() for s in sizes])).all()
    w0, w1 = (torch.load(tmp_path / f"params{r}.pt", weights_only=True) for r in (0, 1))
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))


def test_local_weights_needs_ddp():
    model = tiny_model()
    with pytest.raises(ValueError, match="local_weights: True needs a DistributedDataParallel"):
        ampviz.Recorder(model, local_weights=True)


def test_weight_gradients_are_unscaled_for_a_fused_optimizer_under_a_grad_scaler():
    # GradScaler hands a fused optimizer (fused=True; transformers' default adamw_torch_fused) its gradients scaled,
    # with optimizer.grad_scale; the kernel unscales them in place (not on a step it skips). Both kinds of optimizer
    # must be recorded as unscaled, skipped steps too
    def train(fused):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=None if fused else False)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 22, growth_interval=2)
        g = torch.Generator().manual_seed(1)
        after_step = []                                   # each step's .grad after scaler.step
        with ampviz.Recorder(model, opt, scaler, activations=False) as rec:
            for _ in range(8):
                x, y = torch.randn(16, 10, generator=g) * 100, torch.randint(0, 3, (16,), generator=g)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                after_step.append(np.stack([H.histogram(p.grad) for p in model.parameters()]))
                scaler.update()
                opt.zero_grad(set_to_none=True)
                rec.step(loss)
        return rec.run, np.stack(after_step)

    plain, plain_unscaled = train(fused=False)            # unscale_ divided every step's gradients in place
    fused, fused_after = train(fused=True)
    skipped = plain.skipped[0]
    assert skipped.any() and not skipped.all() and (fused.skipped[0] == skipped).all()
    np.testing.assert_array_equal(plain.counts[0], plain_unscaled)
    applied = ~skipped
    np.testing.assert_array_equal(fused.counts[0, applied], fused_after[applied])    # the kernel's own unscaling
    # until the first applied update both runs have the same weights, hence the same (unscaled) gradients
    same = slice(0, int(np.argmax(applied)) + 1)
    np.testing.assert_array_equal(fused.counts[0, same], plain.counts[0, same])
    assert fused.counts[0, skipped][..., H.ABOVE].sum() + fused.counts[0, skipped][..., H.NAN].sum() > 0


def test_a_framework_that_keeps_gradients_and_scaler_itself_counts_weights_and_gives_scale_and_skips():
    # the contract ampviz.integrations.deepspeed fills (Recorder._framework), here with a plain SGD loop: the
    # framework counts the weights itself just before its step (no .grad hooks of the recorder's), and gives
    # each step's scale and skipped flag, which are recorded as given (not derived from the scale)
    from ampviz import histogram as H
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(model.parameters())

    class Framework:
        steps, removed = 0, False

        def install(self, capture):
            framework = self

            class Handle:
                def remove(self):
                    framework.removed = True
            self.capture = capture
            return Handle()

        def before_step(self):
            self.capture.count_weights_from((i, p.grad[:1]) for i, p in enumerate(params))   # a "partition"
            self.steps += 1

        def scale(self):
            return 2.0 ** (8 - self.steps)

        def skipped(self):
            return self.steps == 2

        def meta(self):
            return {"framework": {"steps": self.steps}}

    rec = ampviz.Recorder(model)
    rec._framework = fw = Framework()
    expected = []
    with rec:
        for _ in range(3):
            F.mse_loss(model(torch.randn(5, 4)), torch.zeros(5, 2)).backward()
            expected.append([H.histogram(p.grad[:1]).numpy() for p in params])
            fw.before_step()
            opt.step()
            opt.zero_grad(set_to_none=True)
            rec.step()
    run = rec.run
    assert fw.removed
    w = run.tensors_of("weight")
    np.testing.assert_array_equal(run.counts[0][:, w], np.asarray(expected))
    assert run.next_scale[0].tolist() == [128.0, 64.0, 32.0] and run.loss_scale[0].tolist() == [256.0, 128.0, 64.0]
    assert run.skipped[0].tolist() == [False, True, False]                # as given, though every scale went down
    assert run.meta["framework"] == {"steps": 3}
    assert (run.counts[0][:, run.tensors_of("activation")].sum(axis=-1) > 0).all()


def test_a_deepspeed_engine_given_as_the_model_is_sent_to_the_integration():
    # told by its class name and module (deepspeed is not imported): a stand-in class like DeepSpeed's
    engine_class = type("DeepSpeedEngine", (nn.Module,), {"__module__": "deepspeed.runtime.engine"})
    engine = type("PipelineEngine", (engine_class,), {"__module__": "deepspeed.runtime.pipe.engine"})()
    with pytest.raises(TypeError, match=r"model: a DeepSpeed engine \(PipelineEngine\); record it with "
                                        r"ampviz.integrations.deepspeed.Recorder\(engine\)"):
        ampviz.Recorder(engine)
    from ampviz.integrations.deepspeed import is_engine
    assert is_engine(engine) and not is_engine(nn.Linear(1, 1))

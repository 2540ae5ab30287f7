"""ampviz.examples.trainer: the lessons' training loop, checked against a plain loop and a real GradScaler."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ampviz.examples.trainer import train_classifier
from ampviz.lessons.data import digits
from ampviz.lessons.models import relu_mlp, sigmoid_mlp
from ampviz.lessons.underflow import static_scaler


@pytest.fixture(scope="module")
def data():
    return digits(seed=0)


def test_fp32_run_matches_a_plain_loop_and_records_every_step(data):
    res = train_classifier(relu_mlp(seed=0, depth=1, width=16), data, steps=12, batch_size=32, lr=1e-2, seed=3)
    # oracle: the same loop written out, with no recorder
    model = relu_mlp(seed=0, depth=1, width=16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(12):
        idx = torch.randint(0, len(data.x_train), (32,), generator=g)
        loss = F.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    np.testing.assert_allclose(res.losses, losses, rtol=1e-6)
    for a, b in zip(res.model.parameters(), model.parameters()):
        assert torch.equal(a, b)                                  # the recorder never changes training
    assert res.run.n_steps == 12 and res.run.hist_steps.size == 12
    assert res.weights_changed.all() and not res.skipped.any()
    np.testing.assert_allclose(res.run.loss[0], res.losses, rtol=1e-6)
    assert 0.0 <= res.test_accuracy <= 1.0


def test_skipped_steps_leave_weights_untouched(data):
    # an init_scale far too high: the first steps overflow in fp16 and are skipped
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40, growth_interval=5)
    res = train_classifier(sigmoid_mlp(seed=0, depth=2, width=16), data, steps=40, batch_size=32,
                           amp_dtype=torch.float16, scaler=scaler)
    skipped = res.skipped
    assert skipped[:3].all() and skipped.sum() < 40
    assert not res.weights_changed[skipped].any()
    assert res.weights_changed[~skipped].all()
    scale = res.run.loss_scale[0]
    np.testing.assert_array_equal(res.run.next_scale[0][skipped], scale[skipped] / 2)


def test_static_scaler_keeps_its_scale(data):
    res = train_classifier(sigmoid_mlp(seed=0, depth=2, width=16), data, steps=30, batch_size=32,
                           amp_dtype=torch.float16, scaler=static_scaler("cpu", 2.0 ** 8), every=10)
    assert not res.skipped.any()
    assert set(res.run.loss_scale[0]) == {2.0 ** 8}
    assert res.run.hist_steps.tolist() == [0, 10, 20]


def test_no_record_and_bad_arguments(data):
    res = train_classifier(relu_mlp(seed=0, depth=1, width=8), data, steps=3, record=False)
    assert res.run is None and res.losses.shape == (3,)
    with pytest.raises(ValueError, match="record=False"):
        _ = res.skipped
    model = relu_mlp(depth=1, width=8)
    with pytest.raises(ValueError, match="steps"):
        train_classifier(model, data, steps=0)
    with pytest.raises(ValueError, match="amp_dtype"):
        train_classifier(model, data, steps=1, amp_dtype=torch.float64)
    with pytest.raises(TypeError, match="scaler"):
        train_classifier(model, data, steps=1, scaler="yes")
    with pytest.raises(ValueError, match="scale"):
        static_scaler("cpu", -1.0)


def test_regression_split_trains_with_its_own_loss_and_reports_no_accuracy():
    from ampviz.lessons.data import diabetes
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 1)
    res = train_classifier(model, diabetes(), steps=5, batch_size=16, lr=1e-1,
                           loss_fn=lambda out, y: F.mse_loss(out.squeeze(-1), y))
    assert np.isnan(res.test_accuracy) and np.isfinite(res.losses).all() and res.weights_changed.all()


def test_sharded_evaluation_on_two_gloo_ranks_equals_the_single_process_evaluation():
    from ampviz.lessons import ddp_ranks
    from ampviz.lessons.launch import launch
    ranks = launch(ddp_ranks.sharded_evaluation, 2, args=(359,), timeout=150)
    assert [r["per_rank"] for r in ranks] == [180, 180]             # 359 padded to 360: one example twice
    loss0, acc0 = ranks[0]["rank0"]                                  # rank 0 alone, the whole split
    for r in ranks:
        loss, acc = r["sharded"]
        assert acc == acc0 and abs(loss - loss0) <= 1e-6 * abs(loss0)
    assert abs(acc0 * 359 - round(acc0 * 359)) < 1e-3       # a count out of 359 (k / 360 is never within 1e-3 / 359)


def test_sharded_evaluation_in_one_process_is_evaluate(data):
    from ampviz.examples.trainer import Trainer
    model = relu_mlp(seed=0, depth=1, width=16)
    trainer = Trainer(model, None, None, device="cpu", amp_dtype=None)
    loss, acc = trainer.evaluate(data.x_test[:101], data.y_test[:101])
    loss_s, acc_s = trainer.evaluate_sharded(data.x_test[:101], data.y_test[:101])
    assert acc_s == acc and abs(loss_s - loss) <= 1e-6 * loss


def _pieces(seed=0, init_scale=2.0 ** 16, warmup=3, total=12, clip=None):
    from ampviz.examples.trainer import Trainer, linear_warmup
    model = sigmoid_mlp(seed=seed, depth=2, width=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=3)
    scheduler = linear_warmup(opt, warmup, total)
    return Trainer(model, opt, scaler, device="cpu", amp_dtype=torch.float16, accum=2, progress=False,
                   max_grad_norm=clip, scheduler=scheduler)


def _loader(data, batch=32):
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    dataset = TensorDataset(data.x_train, data.y_train)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True)
    return DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=True)


def test_clipping_unscales_first_and_matches_a_written_out_loop(data):
    trainer = _pieces(clip=0.05, warmup=0)                          # warmup 0: the full lr at once
    batches = [(data.x_train[i:i + 32], data.y_train[i:i + 32]) for i in (0, 32)]
    trainer.train_step(batches)
    # oracle: the recipe of PyTorch's AMP examples, written out
    model = sigmoid_mlp(seed=0, depth=2, width=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y) / 2
        scaler.scale(loss).backward()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    assert norm > 0.05                                               # the clip did bite
    scaler.step(opt)
    scaler.update()
    for a, b in zip(trainer.module.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_the_scheduler_does_not_step_on_skipped_steps(data):
    trainer = _pieces(init_scale=2.0 ** 40, warmup=4, total=20)      # the first steps overflow fp16
    loader = _loader(data)
    trainer.train(loader, loader.sampler, 10)
    skipped = 10 - trainer.scheduler.last_epoch
    assert skipped >= 2 and trainer.scaler.get_scale() < 2.0 ** 40   # several skips happened ...
    taken = trainer.scheduler.last_epoch                             # ... and only real steps advanced the LR
    factor = (taken + 1) / 4 if taken < 4 else (20 - taken) / 16
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * factor)


def test_batches_resume_at_the_same_micro_batch_across_epochs(data):
    trainer = _pieces()
    loader = _loader(data, batch=256)                                 # 5 micro-batches an epoch: 2 steps
    whole = [g for _, g in zip(range(7), trainer.batches(loader, loader.sampler))]
    later = [g for _, g in zip(range(3), trainer.batches(loader, loader.sampler, start=4))]
    for a, b in zip(whole[4:], later):
        assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))
    assert not torch.equal(whole[0][0][0], whole[2][0][0])           # epochs differ (set_epoch)


def test_a_resumed_run_is_bit_identical_to_an_uninterrupted_one(data, tmp_path):
    loader = _loader(data)
    straight = _pieces(init_scale=2.0 ** 24, clip=1.0)
    straight.train(loader, loader.sampler, 6, eval_every=6, state=tmp_path / "state.pt")
    saved = torch.load(tmp_path / "state.pt", weights_only=True)    # plain tensors and numbers
    assert saved["step"] == 6 and saved["scaler"]["scale"] == straight.scaler.get_scale()
    straight.train(loader, loader.sampler, 12)
    resumed = _pieces(seed=5, init_scale=2.0 ** 24, clip=1.0)        # other weights, a fresh scaler
    resumed.resume(tmp_path / "state.pt")
    assert resumed.step == 6
    resumed.train(loader, loader.sampler, 12)
    for a, b in zip(straight.module.parameters(), resumed.module.parameters()):
        assert torch.equal(a, b)
    assert resumed.scaler.get_scale() == straight.scaler.get_scale()
    assert resumed.scheduler.last_epoch == straight.scheduler.last_epoch
    forgot = _pieces(seed=5, init_scale=2.0 ** 24, clip=1.0)         # everything but the scaler restored
    forgot.load_state_dict({**saved, "scaler": {}})
    forgot.train(loader, loader.sampler, 12)
    assert not all(torch.equal(a, b) for a, b in zip(straight.module.parameters(), forgot.module.parameters()))


def test_trainer_and_schedule_reject_bad_arguments():
    from ampviz.examples.trainer import Trainer, linear_warmup
    model = relu_mlp(depth=1, width=8)
    with pytest.raises(ValueError, match="max_grad_norm: expected a positive number or None, got 0"):
        Trainer(model, None, None, device="cpu", max_grad_norm=0)
    with pytest.raises(ValueError, match="warmup: expected an integer >= 0, got -1"):
        linear_warmup(torch.optim.SGD(model.parameters(), lr=0.1), -1, 10)

"""ampviz.examples.trainer: the lessons' training loop, checked against a plain loop and a real GradScaler."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ampviz.examples.data import digits
from ampviz.examples.models import relu_mlp, sigmoid_mlp
from ampviz.examples.trainer import train_classifier
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
    from ampviz.examples.data import diabetes
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 1)
    res = train_classifier(model, diabetes(), steps=5, batch_size=16, lr=1e-1,
                           loss_fn=lambda out, y: F.mse_loss(out.squeeze(-1), y))
    assert np.isnan(res.test_accuracy) and np.isfinite(res.losses).all() and res.weights_changed.all()


def test_sharded_evaluation_on_two_gloo_ranks_equals_the_single_process_evaluation():
    from ampviz.examples import ddp_basics
    from ampviz.examples.distributed import launch
    ranks = launch(ddp_basics.sharded_evaluation, 2, args=(359,), timeout=150)
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

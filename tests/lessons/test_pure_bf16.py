"""ampviz.lessons.pure_bf16: lesson 07 §4's claims hold for every seed and thread count, not just the lesson's.

The stall is structural: a LayerNorm weight starts at 1.0, which bf16 moves only for an update above 2**-9, and Adam
at lr 1e-4 steps by at most about lr. These tests rerun the lesson's two recorded runs over seeds and with one and two
threads (different reduction orders, so different rounding) and assert what the notebook asserts.
"""

import numpy as np
import pytest
import torch

from ampviz.lessons.data import digits
from ampviz.lessons.pure_bf16 import OUTCOMES, compare, moved_elements, stall_figure, train_recorded, update_shares

PURE, MASTER = "pure bf16", "fp32 master"


@pytest.fixture(scope="module")
def data():
    return digits(seed=0)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("n_threads, seeds", [(1, range(5)), (2, range(1))])   # two threads: other reduction orders
def test_the_lessons_claims_hold_for_every_seed(data, threads, n_threads, seeds):
    threads(n_threads)
    for seed in seeds:
        result = compare(data, seed=seed)
        shares, models = result["shares"], result["models"]
        stalled = {run: {p: s["stalled"] for p, s in per.items()} for run, per in shares.items()}
        # (a): not one norm weight moved, by the recording and by the model
        assert result["norm_moved"][PURE] == 0 and shares[PURE]["norm.weight"]["moved"] == 0, seed
        assert (models[PURE].norm.weight == 1).all() and models[PURE].norm.weight.dtype == torch.bfloat16, seed
        assert stalled[PURE]["norm.weight"] > 0.5, seed
        assert stalled[PURE]["norm.bias"] < 0.25 and min(stalled[PURE].values()) == stalled[PURE]["norm.bias"], seed
        assert all(stalled[PURE][p] > 0.5 for p in stalled[PURE] if not p.startswith("norm.")), seed
        assert shares[PURE]["norm.bias"]["moved"] > 0.5, seed
        assert result["dtypes"][PURE] == {"parameters": {"torch.bfloat16"}, "Adam's state": {"torch.bfloat16"}}
        # (b): the same updates land on fp32 weights, and were far below what bf16 needs at 1.0
        assert result["norm_moved"][MASTER] > 0 and result["norm_drift"][MASTER] > 10 * 1e-4, seed
        assert result["measured_steps"] == 40, seed                 # every 5th of 200: the bound is on these
        assert result["largest_rel_step"][MASTER] <= 2.0 ** -10, seed   # seen: 2^-12, 2^-11 at worst (seed 3)
        assert result["dtypes"][MASTER] == {"parameters": {"torch.float32"}, "Adam's state": {"torch.float32"}}
        assert max(stalled[MASTER].values()) < 0.01, seed
        assert min(s["moved"] for s in shares[MASTER].values()) > 0.9, seed
        blank = (data.x_train == 0).all(dim=0).float().mean().item()
        grey = shares[MASTER]["fc.weight"]["still, zero gradient"]
        assert blank > 0 and blank <= grey < 2 * blank, seed         # "mostly" the always-blank pixels' weights
        # the doctor: (a) weights_stall, norm weights first; (b) none, but bf16 would lose every norm update
        found = {run: {f["check"]: f for f in r["findings"]} for run, r in result["reports"].items()}
        stall = found[PURE]["weights_stall"]
        assert stall["tensors"][0] == "norm.weight" and "norm.bias" not in stall["tensors"], seed
        assert "weights_stall" not in found[MASTER], seed
        assert found[MASTER]["bf16_weights_would_stall"]["evidence"]["tensors"]["norm.weight"]["lost_certain"] == 1.0
        state = found[MASTER]["bf16_optimizer_state_would_stall"]       # (b): a bf16 exp_avg_sq would freeze
        assert state["severity"] == "info", seed
        assert state["evidence"]["states"]["exp_avg_sq"]["tensors"]["fc.weight"] > 0.3, seed


def test_most_of_each_linear_layer_starts_where_a_step_of_lr_is_lost():
    from ampviz.lessons.pure_bf16 import norm_net
    def half_gap_above(x):                                          # an actual bf16 neighbour, from torch
        w = torch.tensor(x, dtype=torch.bfloat16)
        return (torch.nextafter(w, torch.tensor(1.0, dtype=torch.bfloat16)) - w).item() / 2
    cutoff = next(2.0 ** e for e in range(-16, 0) if half_gap_above(2.0 ** e) > 1e-4)
    assert cutoff == 2.0 ** -5 and half_gap_above(cutoff) == 2.0 ** -13 and cutoff < 2 ** 9 * 1e-4
    assert torch.tensor(cutoff + 2 ** -12, dtype=torch.bfloat16) + 1e-4 == cutoff + 2 ** -12     # lost: a real add
    assert torch.tensor(cutoff / 2 + 2 ** -13, dtype=torch.bfloat16) + 1e-4 != cutoff / 2 + 2 ** -13  # lands below
    for seed in range(5):
        init = norm_net(seed)
        for layer in (init.fc, init.head):
            assert (layer.weight.abs() >= cutoff).float().mean() > 0.6, seed


def test_update_shares_match_the_run_arrays_and_add_up(data):
    run, model, _ = train_recorded(data, pure=True, steps=12, updates=4)
    assert run.update_steps.tolist() == [0, 4, 8]
    shares = update_shares(run)
    assert list(shares) == [n for n, _ in model.named_parameters()]
    for s in shares.values():
        assert list(s) == list(OUTCOMES) and sum(s.values()) == pytest.approx(1.0)
    j = [run.tensor_names[t] for t in run.tensors_of("weight")].index("norm.weight")
    stepped = run.update_counts[:, :, j].sum()
    assert shares["norm.weight"]["stalled"] == run.update_stalled[:, :, j].sum() / stepped
    assert moved_elements(run, "norm.weight") == 0 == shares["norm.weight"]["moved"]
    assert stepped == 3 * 64                                    # 3 measured steps, 64 norm weights


def test_stall_figure_puts_norm_parameters_first_and_stacks_three_fates(data):
    shares = {"a": update_shares(train_recorded(data, pure=True, steps=5, updates=5)[0]),
              "b": update_shares(train_recorded(data, pure=False, steps=5, updates=5)[0])}
    fig = stall_figure(shares)
    assert len(fig.data) == 2 * len(OUTCOMES) and fig.layout.barmode == "stack"
    assert list(fig.data[0].y[:2]) == ["norm.weight", "norm.bias"]
    np.testing.assert_allclose(fig.data[0].x, [shares["a"][n]["stalled"] for n in fig.data[0].y])
    assert len(fig.layout.annotations) >= 2 * 6                 # one stalled share per bar (plus subplot titles)
    with pytest.raises(ValueError, match="shares"):
        stall_figure({})


def test_largest_rel_step_bounds_the_real_steps(data):
    from ampviz.lessons.pure_bf16 import largest_rel_step, norm_net
    run, model, _ = train_recorded(data, pure=False, steps=1, updates=1)
    w0 = norm_net(0).norm.weight.detach().double()
    rel = ((model.norm.weight.detach().double() - w0).abs() / w0.abs()).max().item()
    bound = largest_rel_step(run, "norm.weight")
    assert bound / 2 < rel <= bound                             # the top edge of the binade holding the largest step
    assert largest_rel_step(train_recorded(data, pure=True, steps=1, updates=1)[0], "norm.weight") == 0.0


def test_update_shares_needs_recorded_updates(data):
    import ampviz
    from ampviz.lessons.pure_bf16 import norm_net
    model = norm_net(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    rec = ampviz.Recorder(model, opt, activations=False)
    with rec:
        model(data.x_train[:8]).sum().backward()
        opt.step()
        rec.step(0.0)
    with pytest.raises(ValueError, match="no updates recorded"):
        update_shares(rec.run)

"""Muon's Newton–Schulz iteration: ampviz's copy against torch's own (bit for bit), a real Muon step, and what
fp16 autocast does to it (different products, not a worse orthogonalisation)."""

import statistics

import pytest
import torch

from ampviz.lessons.muon import muon_defaults, muon_update, newton_schulz, orthogonalization_errors, update_by_muon


@pytest.mark.parametrize("shape", [(16, 16), (8, 24), (24, 8)])
def test_newton_schulz_is_torchs_iteration_bit_for_bit(shape):
    # the oracle: torch's own (private) function
    from torch.optim._muon import _zeropower_via_newtonschulz
    d = muon_defaults()
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    assert torch.equal(newton_schulz(g), _zeropower_via_newtonschulz(g, d["ns_coefficients"], d["ns_steps"], d["eps"]))


def test_a_real_muon_step_makes_that_update_outside_and_inside_fp16_autocast():
    g = torch.randn(32, 32, generator=torch.Generator().manual_seed(2))
    assert torch.equal(update_by_muon(g).bfloat16(), muon_update(g))
    inside = muon_update(g, torch.float16)
    assert inside.dtype == torch.float16 and torch.equal(update_by_muon(g, torch.float16).half(), inside)
    assert not torch.equal(inside.float(), muon_update(g).float())
    assert torch.equal(muon_update(g, torch.bfloat16), muon_update(g))     # bf16 autocast: Muon's own dtype
    with pytest.raises(ValueError, match="square"):
        update_by_muon(torch.randn(3, 4))
    with pytest.raises(ValueError, match="2-D"):
        newton_schulz(torch.randn(3))


def test_fp16_products_are_no_farther_from_the_exact_iteration_than_bf16_ones():
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(32, 48, generator=gen) * 10 ** float(k) for k in range(-3, 3)]
    err = orthogonalization_errors(grads)
    assert statistics.median(err["autocast"]) <= statistics.median(err["bfloat16"])
    assert all(0 < b for b in err["between"]) and statistics.median(err["between"]) < statistics.median(err["bfloat16"])


def test_most_of_both_16_bit_errors_is_the_shared_bf16_rounding_of_the_gradient():
    """The appendix's explanation of the small fp16 gain: on the MLP's real gradients the float64 iteration started
    from the bf16-rounded gradient is already most of the way to the 16-bit updates' distance (on well-conditioned
    randn matrices much less), and exact when no rounding happens."""
    import torch.nn.functional as F

    from ampviz.lessons.data import digits
    from ampviz.lessons.models import MLP
    data, grads = digits(seed=0), []
    for seed in range(3):                  # real gradients, as the appendix uses (low rank, unlike randn)
        torch.manual_seed(seed)
        model = MLP(64, 64, depth=2, d_out=10)
        batch = slice(64 * seed, 64 * (seed + 1))
        F.cross_entropy(model(data.x_train[batch]), data.y_train[batch]).backward()
        grads += [p.grad for p in model.parameters() if p.ndim == 2]
    err = orthogonalization_errors(grads)
    assert statistics.median(err["rounded input"]) > 0.5 * statistics.median(err["bfloat16"])
    gen = torch.Generator().manual_seed(0)
    exact_in_bf16 = torch.randn(16, 16, generator=gen).bfloat16().float()      # nothing left to round
    assert orthogonalization_errors([exact_in_bf16])["rounded input"] == [0.0]

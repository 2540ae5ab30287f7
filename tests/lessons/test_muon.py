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

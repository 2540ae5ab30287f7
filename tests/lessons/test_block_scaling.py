"""ampviz.lessons.block_scaling against real casts, ampviz.blocks' exact MX predictions and fp8_scaling's GEMMs."""

from functools import partial

import pytest
import torch

from ampviz.blocks import block_counts, what_if
from ampviz.lessons.block_scaling import (
    BLOCK_SIZES,
    BlockSizeExplorer,
    cast_gemm_errors,
    mx_fates,
    quantize_blocks,
    quantize_nvfp4,
    round_e2m1,
)
from ampviz.lessons.fp8_scaling import LinearOperands, gemm_errors, quantize


def spread(rows=64, cols=96, binades=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.exp2(-binades * torch.rand(rows, cols, generator=g))


def operands(seed=0):
    g = torch.Generator().manual_seed(seed)
    return LinearOperands(torch.randn(64, 96, generator=g), torch.randn(32, 96, generator=g) * 0.1,
                          spread(64, 32, 20, seed + 1))


def test_e2m1_rounds_onto_its_grid_to_nearest_even():
    q = torch.tensor([0.2, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 7.0, -2.5])
    assert round_e2m1(q).tolist() == [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 8.0, -2.0]


@pytest.mark.parametrize("element, recipe", [("e4m3", "mxfp8_e4m3"), ("e5m2", "mxfp8_e5m2"), ("e2m1", "mxfp4")])
def test_mx_casts_match_ampviz_blocks_exact_counts(element, recipe):
    for x in (spread(), spread(cols=40, binades=40, seed=3)):          # 40 columns: a zero-padded last block
        w = what_if(block_counts(x, "mx32", pad=True), recipe)
        real = mx_fates(x, element, 32)
        assert w.exact and (w.nonzero, w.flushed[0], w.saturated[0]) == (real["nonzero"], real["flushed"],
                                                                          real["saturated"])
        assert real["saturated"] > 0


def test_mx_scale_is_a_power_of_two_per_block_and_rceil_never_saturates():
    x = spread()
    for rule in ("ocp", "rceil"):
        q = quantize_blocks(x, "e4m3", 32, rule)
        assert q.shape == x.shape and torch.all(q.abs().view(64, 3, 32).amax(2) <= x.abs().view(64, 3, 32).amax(2)
                                                * (1 + 2.0 ** -4))
    for t in (x, x.T.contiguous(), operands().x, operands().grad.T.contiguous()):   # rows, columns, real-ish
        fit, tensor = quantize_blocks(t, "e4m3", 32, "rceil"), quantize(t, "fp8_e4m3fn")
        assert torch.all((fit - t).abs() <= (tensor - t).abs())        # a finer power-of-two scale rounds no worse
    fit, ocp = quantize_blocks(x, "e4m3", 32, "rceil"), quantize_blocks(x, "e4m3", 32)
    assert ((ocp - x).abs() > (fit - x).abs()).any()                   # OCP's scale saturates some block maxima
    block_max = lambda q: q.abs().view(64, 3, 32).amax(2)                # noqa: E731
    assert torch.all(block_max(fit) >= block_max(x) * (1 - 2.0 ** -4))  # RCEIL: every block max kept, never clipped
    whole = quantize_blocks(x, "e4m3", None, "rceil")
    assert torch.equal(whole, quantize(x, "fp8_e4m3fn", "row"))       # a whole row = fp8_scaling's row-wise cast


def test_nvfp4_is_a_two_level_scale_with_e2m1_elements():
    x = spread(binades=8)
    q = quantize_nvfp4(x)
    t = x.abs().amax() / (448 * 6)
    s = (x.view(64, 6, 16).abs().amax(2, keepdim=True) / (6 * t)).to(torch.float8_e4m3fn).float() * t
    e = q.view(64, 6, 16) / s                                          # the E2M1 elements (up to fp32 rounding)
    assert torch.allclose(e, round_e2m1(e), rtol=1e-5, atol=0) and e.abs().max() <= 6 * (1 + 1e-6)
    assert torch.equal(q.view(64, 6, 16), round_e2m1(x.view(64, 6, 16) / s).clamp(-6, 6) * s)   # tests/test_blocks'
    assert torch.equal(quantize_nvfp4(torch.zeros(2, 16)), torch.zeros(2, 16))


def test_cast_gemm_errors_agree_with_fp8_scaling_for_tensor_and_row_casts():
    ops = operands()
    for cast, granularity in ((partial(quantize, format="fp8_e4m3fn"), "tensor"),
                              (partial(quantize, format="fp8_e4m3fn", granularity="row"), "row")):
        mine, theirs = cast_gemm_errors(ops, cast), gemm_errors(ops, backward="fp8_e4m3fn", granularity=granularity)
        assert mine == pytest.approx(theirs, rel=1e-4)
    assert max(cast_gemm_errors(ops, lambda t: t).values()) < 1e-6


def test_block_size_explorer_every_control_changes_the_figure():
    w = BlockSizeExplorer({"a": operands(0), "b": operands(5)})
    state = lambda: ([tuple(t.y) for t in w.figure.data], w.figure.layout.title.text, w.readout.value)  # noqa: E731
    first = state()
    assert all(any(v > 0 for v in t.y) for t in w.figure.data)          # starts drawn
    w.block_slider.value = BLOCK_SIZES[-1][0]
    after_slider = state()
    assert after_slider != first and after_slider[0][1] != first[0][1]   # the per-block bars moved
    w.element_dropdown.value = "e2m1"
    after_element = state()
    assert after_element != after_slider and after_element[0][0] != after_slider[0][0]   # both traces change
    w.rule_dropdown.value = "rceil"
    assert state()[0] != after_element[0] and "RCEIL" in state()[1] and state()[2] != after_element[2]
    with pytest.raises(ValueError, match="rule"):
        BlockSizeExplorer({"a": operands()}, rule="floor")
    with pytest.raises(ValueError, match="block"):
        BlockSizeExplorer({"a": operands()}, block="7")

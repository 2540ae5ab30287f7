"""ampviz.blocks against real casts: OCP MX (E8M0 scale via ``torch.float8_e8m0fnu``, elements via
``torch.float8_e4m3fn`` / ``torch.float8_e5m2``), NVFP4 (E4M3 block scale via ``torch.float8_e4m3fn``), row-wise and
tiled fp8 (``torch.float8_e4m3fn``), on the activations, weights and output gradients of a small random-init
transformer and on adversarial tensors.

E2M1 (MXFP4, NVFP4 elements): torch 2.13 has ``torch.float4_e2m1fn_x2`` only as a packed storage dtype; casting to it
is not implemented on the CPU ("copy_kernel" not implemented for 'Float4_e2m1fn_x2'), so :func:`round_e2m1` rounds
onto the grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} to nearest-even itself (checked against the grid by hand below).

"Saturated" is read off a real cast without the clamp: E5M2 gives inf; E4M3, whose torch cast saturates, is cast at
half the value (same 3-bit rounding one binade down) and saturated if the doubled result exceeds 448; E2M1 rounds
past 6 (to 8)."""

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ampviz.blocks import LAYOUTS, BlockLayout, _cpu_kernel, block_counts, get_layout, what_if
from ampviz.blocks.counts import D_MAX

E8M0, E4M3, E5M2 = torch.float8_e8m0fnu, torch.float8_e4m3fn, torch.float8_e5m2
EMAX = {"mxfp8_e4m3": 8, "mxfp8_e5m2": 15, "mxfp4": 2}


@pytest.fixture(autouse=True, params=["numba", "torch"])
def counter(request, monkeypatch):
    """Every test runs with both CPU paths of block_counts: the numba kernel and the torch ops (the GPU's)."""
    if request.param == "numba" and not _cpu_kernel.available():
        pytest.skip("numba is not installed")
    monkeypatch.setenv("AMPVIZ_COUNTER", request.param)
    return request.param


# ------------------------------------------------------------------------------------------- reference casts
def round_e2m1(q: torch.Tensor) -> torch.Tensor:
    """Round to E2M1 nearest-even *without* clamping (|q| > 6 may give 8, 12, ...): 1 mantissa bit, emin 0."""
    a = q.abs()
    e = torch.floor(torch.log2(torch.where(a > 0, a, 1.0))).clamp(min=0)   # subnormals share emin = 0
    quantum = torch.exp2(e - 1)
    r = torch.round(a / quantum) * quantum                                # torch.round: half to even
    return torch.copysign(r, q)


def round_element(q: torch.Tensor, element: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the saturating cast of q, which values were saturated), each from a real cast."""
    if element == "e4m3":
        saturated = (q / 2).to(E4M3).float().abs() * 2 > 448
        return q.clamp(-448, 448).to(E4M3).float(), saturated
    if element == "e5m2":
        saturated = torch.isinf(q.to(E5M2).float())
        return q.clamp(-57344, 57344).to(E5M2).float(), saturated
    r = round_e2m1(q)
    return r.clamp(-6, 6), r.abs() > 6


def blocks_of(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    m = x.reshape(-1, x.shape[-1])
    m = F.pad(m, (0, -m.shape[1] % cols, 0, -m.shape[0] % rows))
    return m.view(m.shape[0] // rows, rows, m.shape[1] // cols, cols).permute(0, 2, 1, 3).reshape(-1, rows * cols)


def floor_log2(a: torch.Tensor) -> torch.Tensor:
    return (torch.frexp(a)[1] - 1).float()


def mx_cast(x: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """OCP MX: X = 2**(floor(log2 amax) - emax) as a real E8M0 (torch clamps below 2**-127, as torchao does)."""
    b = blocks_of(x.float(), 1, 32)
    amax = b.abs().amax(dim=1)
    exponent = torch.where(amax > 0, floor_log2(amax) - EMAX[recipe], -127.0)
    scale = torch.exp2(exponent).to(E8M0).float()                         # exact in [2**-127, 2**127]
    assert torch.equal(scale, torch.exp2(exponent.clamp(min=-127)))
    q = b / scale[:, None]
    element = {"mxfp8_e4m3": "e4m3", "mxfp8_e5m2": "e5m2", "mxfp4": "e2m1"}[recipe]
    cast, saturated = round_element(q, element)
    return b, cast * scale[:, None], saturated


def nvfp4_cast(x: torch.Tensor):
    """NVFP4 with a per-tensor fp32 scale T = amax / (448 * 6) and E4M3 block scales of 16."""
    b = blocks_of(x.float(), 1, 16)
    tensor_scale = b.abs().amax() / (448 * 6)
    block_scale = (b.abs().amax(dim=1) / (6 * tensor_scale)).to(E4M3).float()
    scale = torch.where(block_scale > 0, block_scale * tensor_scale, 1.0)[:, None]   # all-zero blocks: any scale
    cast, saturated = round_element(b / scale, "e2m1")
    return b, cast * scale, saturated


def amax_cast(x: torch.Tensor, rows: int, cols: int):
    """Row-wise / tiled fp8: v * (448 / amax) in fp32, saturating E4M3 cast, divided back."""
    b = blocks_of(x.float(), rows, cols)
    amax = b.abs().amax(dim=1)
    scale = torch.where(amax > 0, 448 / amax, 1.0)[:, None]                          # all-zero blocks: any scale
    cast, saturated = round_element(b * scale, "e4m3")
    return b, cast / scale, saturated


def real(b, deq, saturated) -> dict:
    b, deq = b.double(), deq.double()
    nonzero = b != 0
    flushed = nonzero & (deq == 0)
    total = (b ** 2).sum()
    return {"flushed": int(flushed.sum()), "saturated": int((saturated & nonzero).sum()), "nonzero": int(nonzero.sum()),
            "norm_lost": float((b[flushed] ** 2).sum() / total),
            "rms": float(((deq - b) ** 2).sum().sqrt() / total.sqrt())}


def cast_for(recipe: str, x: torch.Tensor, layout: str):
    if recipe in EMAX:
        return mx_cast(x, recipe)
    if recipe == "nvfp4":
        return nvfp4_cast(x)
    layout = get_layout(layout)
    return amax_cast(x, layout.block_rows, layout.block_cols or x.shape[-1])


def check(x: torch.Tensor, recipe: str, layout: str, pad: bool = False):
    w = what_if(block_counts(x, layout, pad=pad), recipe)
    r = real(*cast_for(recipe, x, layout))
    assert w.nonzero == r["nonzero"]
    assert w.flushed[0] <= r["flushed"] <= w.flushed[1], (recipe, w, r)
    assert w.saturated[0] <= r["saturated"] <= w.saturated[1], (recipe, w, r)
    assert w.norm_lost[0] * (1 - 1e-9) <= r["norm_lost"] <= w.norm_lost[1] * (1 + 1e-9) + 1e-300, (recipe, w, r)
    assert w.rms_error[0] * (1 - 1e-9) <= r["rms"] <= w.rms_error[1] * (1 + 1e-9), (recipe, w, r)
    if recipe in EMAX and not w.unsure:
        assert w.exact and w.flushed[0] == r["flushed"] and w.saturated[0] == r["saturated"], (recipe, w, r)
        assert w.norm_lost[0] == pytest.approx(r["norm_lost"], rel=1e-9, abs=1e-300)
    return w, r


RECIPE_LAYOUTS = [("mxfp8_e4m3", "mx32"), ("mxfp8_e5m2", "mx32"), ("mxfp4", "mx32"), ("nvfp4", "nv16"),
                  ("rowwise_fp8", "row"), ("tile_fp8", "tile1x128"), ("tile_fp8", "tile128x128")]


# ------------------------------------------------------------------------------------------- the E2M1 reference
def test_the_e2m1_reference_rounds_onto_the_grid_to_nearest_even():
    q = torch.tensor([0.0, 0.2, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.9, 6.5, 7.0, 7.1, -0.75, -5.0])
    cast, saturated = round_element(q, "e2m1")
    assert cast.tolist() == [0, 0, 0, 0.5, 1, 1, 2, 2, 4, 4, 6, 6, 6, 6, -1, -4]
    assert saturated.tolist() == [False] * 12 + [True, True, False, False]     # 7 is a tie that rounds to 8


# ------------------------------------------------------------------------------------------- a small transformer
@pytest.fixture(scope="module")
def transformer_tensors():
    """Inputs, weights and output gradients of every Linear in a random-init encoder layer, on generated data."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=256, batch_first=True, dropout=0.0)
    seen = {}
    for name, m in layer.named_modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda mod, i, o, n=name: seen.__setitem__(f"{n}.input", i[0].detach()))
            m.register_full_backward_hook(lambda mod, gi, go, n=name: seen.__setitem__(f"{n}.grad_output",
                                                                                         go[0].detach()))
    x = torch.randn(4, 32, 128) * 3
    out = layer(x)
    (out.pow(2).mean() * 1e-3).backward()
    for name, m in layer.named_modules():
        if isinstance(m, nn.Linear):
            seen[f"{name}.weight"] = m.weight.detach()
            seen[f"{name}.weight_grad"] = m.weight.grad.detach()
    seen["self_attn.in_proj_weight"] = layer.self_attn.in_proj_weight.detach()     # (384, 128), not a Linear
    seen["self_attn.in_proj_weight_grad"] = layer.self_attn.in_proj_weight.grad.detach()
    assert len(seen) == 12          # out_proj's hooks do not fire: attention calls its weight directly
    return seen


@pytest.mark.parametrize("recipe,layout", RECIPE_LAYOUTS)
def test_what_if_matches_the_real_cast_on_transformer_tensors(transformer_tensors, recipe, layout):
    for t in transformer_tensors.values():
        check(t, recipe, layout)
        check(t.bfloat16(), recipe, layout)                              # bf16 is exact in fp32


def test_the_transformer_tensors_exercise_flushing_and_saturation(transformer_tensors):
    flushed = saturated = 0
    for t in transformer_tensors.values():
        w = what_if(block_counts(t, "mx32"), "mxfp4")
        flushed, saturated = flushed + w.flushed[0], saturated + w.saturated[0]
    assert flushed > 0 and saturated > 0


# ------------------------------------------------------------------------------------------- adversarial tensors
def wide(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g).float())


def edge_rows() -> torch.Tensor:
    """Blocks of 32 built on the edges: flush ties, saturation ties, exact powers of two, zeros, subnormals."""
    rows = []
    for amax in (1.5, 1.8125, 1.8125 + 2 ** -20, 1.875, 1.875 - 2 ** -20, 1.75, 1.75 - 2 ** -20, 2.0, 1.0 + 2 ** -23):
        edges = [2.0 ** -k * f for k in range(0, 40) for f in (1.0, 1.5)][:31]
        rows.append([amax] + edges)
    ties = [2.0 ** -18, 2.0 ** -18 * (1 + 2 ** -10), 2.0 ** -34, 2.0 ** -34 * 1.0001, 0.25 * 2 ** -2, 0.3 * 2 ** -2,
            2.0 ** -17, 2.0 ** -19]
    rows.append([1.5] + ties + [0.0] * (31 - len(ties)))                 # MX flush ties at E = 0 for every element
    rows.append([1.0] + [1e-40, 2.0 ** -149, -1e-39] + [0.0] * 28)       # fp32 subnormals in an ordinary block
    rows.append([0.0] * 32)                                              # a block of zeros
    rows.append([-x for x in rows[0]])                                   # signs
    return torch.tensor(rows, dtype=torch.float32)


@pytest.mark.parametrize("recipe,layout", RECIPE_LAYOUTS)
def test_what_if_matches_the_real_cast_on_edges_and_wide_values(recipe, layout):
    x = torch.cat([edge_rows().repeat(1, 4), wide(13 * 128 * 3, 1).view(-1, 128)])   # 128 columns, 52 rows
    x = torch.cat([x, torch.zeros(128 - x.shape[0], 128)]) if layout == "tile128x128" else x
    w, r = check(x, recipe, layout)
    if recipe in EMAX:
        assert w.flushed[0] > 0 and w.saturated[0] > 0


@pytest.mark.parametrize("recipe,layout", RECIPE_LAYOUTS)
def test_shapes_that_do_not_fit_the_block_are_padded_with_zeros_when_asked(recipe, layout):
    x = wide(3 * 40, 2).view(3, 40)
    with pytest.raises(ValueError, match=r"x: shape \(3, 40\).*pad=True") if layout != "row" else _nothing():
        block_counts(x, layout)
    check(x, recipe, layout, pad=True)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_blocks_with_inf_or_nan_are_poisoned_and_tiny_blocks_are_unsure():
    x = wide(5 * 32, 3).view(5, 32)
    x[0, 3], x[1, 5] = float("inf"), float("nan")
    x[2] = x[2] * 2.0 ** -110 * 1e-20                                    # amax far below 2**-112
    x[4] = x[4] * 2.0 ** -110 * 1e-20
    x[4, 0] = -float("inf")                                             # tiny and poisoned: poisoned
    c = block_counts(x, "mx32")
    assert int(c.nonfinite) == 3 and int(c.poisoned) == int((x[:2] != 0).sum() + (x[4] != 0).sum()) - 3
    assert int(c.tiny) == int((x[2] != 0).sum())
    assert int(c.d.sum() + c.zero + c.nonfinite + c.poisoned + c.tiny) == x.numel()
    for recipe in EMAX:
        w = what_if(c, recipe)
        assert w.poisoned == int(c.poisoned) and w.unsure == int(c.tiny) and not w.exact
        r = real(*mx_cast(x[2:4], recipe))
        assert w.flushed[0] <= r["flushed"] <= w.flushed[1]
        ordinary = real(*mx_cast(x[3:4], recipe))                       # exact where the blocks are ordinary
        assert w.flushed == (ordinary["flushed"], ordinary["flushed"] + int(c.tiny))
        assert w.saturated == (ordinary["saturated"], ordinary["saturated"] + int(c.tiny))


# ------------------------------------------------------------------------------------------- the counts themselves
def test_d_equals_an_independent_frexp_oracle():
    x = torch.cat([edge_rows(), wide(32 * 40, 4).view(40, 32)])
    a = x.double().abs().numpy()
    m, e = np.frexp(a)
    k = np.where(m == 0.5, e - 2, e - 1)
    amax = a.max(axis=1, keepdims=True)
    big_e = np.frexp(amax)[1] - 1
    d = np.clip(big_e - k, 0, D_MAX)[a > 0]
    assert block_counts(x, "mx32").d.tolist() == np.bincount(d, minlength=D_MAX + 1).tolist()


def test_counts_add_up_and_the_top_bins_split_the_d0_values():
    x = wide(64 * 96, 5).view(64, 96)
    x[::7, ::5] = 0
    for name in LAYOUTS:
        c = block_counts(x, name, pad=True)
        assert int(c.d.sum() + c.zero + c.nonfinite + c.poisoned + c.tiny) == x.numel()
        assert int(c.top.sum()) == int(c.d[0]) and int(c.offset.sum()) == int(c.d.sum())
        assert float(c.sumsq[:D_MAX + 1].sum()) == pytest.approx(float((x.double() ** 2).sum()), rel=1e-12)
    both = block_counts(x, "mx32") + block_counts(x[:32], "mx32")
    assert int(both.d.sum()) == int((x != 0).sum() + (x[:32] != 0).sum())


def test_blocking_follows_dim_and_tiles():
    x = wide(128 * 256, 6).view(128, 256)
    assert torch.equal(block_counts(x, "mx32", dim=0).counts, block_counts(x.T.contiguous(), "mx32").counts)
    assert get_layout("tile128x128").blocks_of((256, 384)) == (2, 3)
    one_tile = torch.randn(128, 128)
    one_tile[5, 7] = 1e6                                                  # one big value sets the whole tile's max
    c = block_counts(one_tile, "tile128x128")
    assert int(c.d[0]) == 1 and int(c.d[:10].sum()) == 1 and int(c.d[15:].sum()) > 0
    assert int(block_counts(one_tile, "tile1x128").d[:10].sum()) > 100   # in 1 x 128 tiles only its row suffers


def test_errors_name_the_argument_the_value_and_what_is_valid():
    with pytest.raises(ValueError, match="layout: unknown block layout 'mx64'; valid: mx32, nv16"):
        block_counts(torch.ones(32), "mx64")
    with pytest.raises(ValueError, match=r"x: shape \(200, 128\) has 200 rows .* valid: a multiple of 128"):
        block_counts(torch.ones(200, 128), "tile128x128")
    with pytest.raises(ValueError, match="block_cols: expected a positive integer or None"):
        BlockLayout("t", 1, 0)
    with pytest.raises(ValueError, match=r"dim: 2 is out of range for a tensor of shape \(4, 32\)"):
        block_counts(torch.ones(4, 32), "mx32", dim=2)
    with pytest.raises(TypeError, match="x: expected a floating-point tensor, got torch.int64"):
        block_counts(torch.ones(32, dtype=torch.int64), "mx32")
    with pytest.raises(ValueError, match="counts: nvfp4 casts blocks of layout nv16; these counts are 'mx32'"):
        what_if(block_counts(torch.ones(32), "mx32"), "nvfp4")
    with pytest.raises(ValueError, match="recipe: unknown recipe 'mxfp6'; valid: mxfp8_e4m3"):
        what_if(block_counts(torch.ones(32), "mx32"), "mxfp6")


def test_the_numba_kernel_and_the_torch_path_count_the_same(monkeypatch, transformer_tensors):
    x = torch.cat([edge_rows().repeat(1, 4), wide(13 * 128 * 3, 1).view(-1, 128)])
    x[3, 5], x[20, 7], x[30] = float("inf"), float("nan"), x[30] * 1e-38
    for t in [x, x[:, :100], *transformer_tensors.values()]:
        for name in LAYOUTS:
            monkeypatch.setenv("AMPVIZ_COUNTER", "torch")
            by_torch = block_counts(t, name, pad=True)
            monkeypatch.setenv("AMPVIZ_COUNTER", "numba")
            by_numba = block_counts(t, name, pad=True)
            assert torch.equal(by_torch.counts, by_numba.counts), name
            assert torch.allclose(by_torch.sumsq, by_numba.sumsq, rtol=1e-12, atol=0), name


@pytest.mark.gpu
def test_counting_makes_no_host_sync():
    x = torch.randn(256, 512, device="cuda")
    x[0, 0] = float("inf")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        counts = [block_counts(x, name, pad=True) for name in LAYOUTS]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    cpu = [block_counts(x.cpu(), name, pad=True) for name in LAYOUTS]
    for on_gpu, on_cpu in zip(counts, cpu):
        assert torch.equal(on_gpu.counts.cpu(), on_cpu.counts)
        assert torch.allclose(on_gpu.sumsq.cpu(), on_cpu.sumsq, rtol=1e-12)
    assert math.isfinite(what_if(counts[0], "mxfp4").rms_error[1])


def test_the_rms_lower_bound_counts_what_saturation_surely_costs():
    """MX E4M3's floor scale clamps a block maximum whose mantissa is above 1.8125 to 448: that error is known from
    the top mantissa bins, so the lower end of rms_error includes it (it once counted flushed values only: 0 here,
    leaving the doctor unsure of tensors whose saturated maxima carry the norm)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 32, generator=g) * 0.5
    x[:, 0] = torch.where(torch.rand(64, generator=g) < 0.5, -1.0, 1.0) * 1.95 * 8      # every block's max, saturated
    w, r = check(x, "mxfp8_e4m3", "mx32")
    assert w.saturated == (64, 64) and w.flushed == (0, 0)
    assert 0.6 * r["rms"] < w.rms_error[0] <= r["rms"] <= w.rms_error[1]


def torchao_cast(x: torch.Tensor, recipe: str) -> torch.Tensor:
    """``x`` (2-D) cast by torchao's own MX / NVFP4 conversion and dequantized to fp32."""
    import warnings
    with warnings.catch_warnings():                  # torchao's import warns about torch's pytree API
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    if recipe == "nvfp4":                            # two-level: fp32 tensor scale amax / (448 * 6), E4M3 block scales
        t = NVFP4Tensor.to_nvfp4(x, block_size=16, per_tensor_scale=per_tensor_amax_to_scale(x.abs().amax()))
        return t.dequantize(torch.float32)
    element = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2,
               "mxfp4": torch.float4_e2m1fn_x2}[recipe]
    return MXTensor.to_mx(x, element, 32, scaling_mode=ScaleCalculationMode.FLOOR).dequantize(torch.float32)


@pytest.mark.parametrize("recipe,layout", [("mxfp8_e4m3", "mx32"), ("mxfp8_e5m2", "mx32"), ("mxfp4", "mx32"),
                                           ("nvfp4", "nv16")])
def test_what_if_matches_torchaos_own_mx_and_nvfp4_casts(transformer_tensors, recipe, layout):
    """torchao 0.18's MXTensor (OCP's floor scale) and NVFP4Tensor (with its per-tensor scale), on the inputs, weights
    and gradients of a transformer layer: MX counts are exact, NVFP4's within the stated bounds."""
    pytest.importorskip("torchao.prototype.mx_formats")
    for name, x in transformer_tensors.items():
        x = x.reshape(-1, x.shape[-1]).float().contiguous()
        w = what_if(block_counts(x, layout), recipe)
        r = real(x, torchao_cast(x, recipe), torch.zeros_like(x, dtype=torch.bool))
        assert w.nonzero == r["nonzero"], name
        assert w.flushed[0] <= r["flushed"] <= w.flushed[1], (name, w, r)
        assert w.norm_lost[0] * (1 - 1e-9) <= r["norm_lost"] <= w.norm_lost[1] * (1 + 1e-9) + 1e-300, (name, w, r)
        assert w.rms_error[0] * (1 - 1e-9) <= r["rms"] <= w.rms_error[1] * (1 + 1e-9), (name, w, r)
        if recipe != "nvfp4":
            assert w.exact and w.flushed[0] == r["flushed"], (name, w, r)

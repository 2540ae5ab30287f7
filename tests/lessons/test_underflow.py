"""ampviz.lessons.underflow against oracles: .grad / retain_grad for the capture, real casts for the scale search."""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampviz
from ampviz import histogram as H
from ampviz.lessons import underflow as U


def tiny(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Sigmoid(), nn.Linear(16, 3))


def batch(seed=1, n=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def log_uniform(n, lo, hi, seed=0):
    g = torch.Generator().manual_seed(seed)
    mags = torch.exp2(torch.empty(n, dtype=torch.float64).uniform_(lo, hi, generator=g)).float()
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return mags * signs


def test_capture_matches_backward_and_leaves_grad_untouched():
    model, (x, y) = tiny(), batch()
    grads = U.capture_gradients(model, F.cross_entropy, x, y, loss_scale=8.0)
    assert all(p.grad is None for p in model.parameters())          # nothing accumulated
    assert list(grads.activations) == ["0", "2", "4"]                # leaf modules with parameters
    # oracle: an ordinary backward with retain_grad on the module outputs
    outs = {}

    def keep(name):
        def hook(module, inputs, output):
            output.retain_grad()
            outs[name] = output
        return hook
    hooks = [m.register_forward_hook(keep(n)) for n, m in model.named_children() if isinstance(m, nn.Linear)]
    (F.cross_entropy(model(x), y) * 8.0).backward()
    for h in hooks:
        h.remove()
    for n, o in outs.items():
        torch.testing.assert_close(grads.activations[n], o.grad, rtol=0, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads.weights[n], p.grad, rtol=0, atol=0)
    assert grads.loss_scale == 8.0 and grads.loss == pytest.approx(float(F.cross_entropy(model(x), y).detach()))


def test_capture_under_fp16_autocast_gives_fp16_activation_grads_and_fp32_weight_grads():
    model, (x, y) = tiny(), batch()
    grads = U.capture_gradients(model, F.cross_entropy, x, y, amp_dtype=torch.float16)
    assert {g.dtype for g in grads.activations.values()} == {torch.float16}
    assert {g.dtype for g in grads.weights.values()} == {torch.float32}


@pytest.mark.parametrize("bad", [dict(amp_dtype=torch.float64), dict(loss_scale=0.0), dict(loss_scale=float("inf"))])
def test_capture_rejects_bad_arguments(bad):
    model, (x, y) = tiny(), batch()
    with pytest.raises(ValueError, match=next(iter(bad))):
        U.capture_gradients(model, F.cross_entropy, x, y, **bad)


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp8_e5m2"])
def test_fate_predictions_equal_real_casts_for_flushes(fmt):
    values = torch.cat([log_uniform(50_000, -60, 20), torch.zeros(100), torch.tensor([2.0 ** -25, 2.0 ** -40])])
    counts = U.counts_of([values])
    for s in range(-4, 45, 3):
        real = H.cast_counts(values, fmt, 2.0 ** s)
        pred = H.fate(counts, fmt, log2_scale=s)
        assert int(pred.flushed) == real["flushed"], s
        assert int(pred.zero) == real["zero"] == 100
        # overflow: exact up to the documented edge set [threshold, 2**(emax+1)]
        f = ampviz.get_format(fmt)
        scaled = values.double().abs() * 2.0 ** s
        edge = int(((scaled >= f.overflow_threshold) & (scaled <= 2.0 ** (f.emax + 1))).sum())
        assert abs(int(pred.overflow) - real["overflow"]) <= edge


def test_smallest_scale_matches_brute_force_real_casts():
    values = torch.cat([torch.full((10,), 2.0 ** -30), torch.full((990,), 2.0 ** -20)])
    counts = U.counts_of(values)
    assert U.smallest_log2_scale(counts, "fp16", keep=0.99) == 0          # 10 of 1000 lost = 1%
    # 2**-30 * 2**5 = 2**-25 is a tie that rounds to zero; 2**6 saves it
    assert U.smallest_log2_scale(counts, "fp16", keep=0.999) == 6
    v = log_uniform(20_000, -45, -5, seed=3)
    def kept(k, keep):
        return H.cast_counts(v, "fp16", 2.0 ** k)["flushed"] <= (1 - keep) * v.numel()
    for keep in (0.5, 0.9, 0.99):
        s = U.smallest_log2_scale(U.counts_of(v), "fp16", keep=keep)
        assert kept(s, keep) and not kept(s - 1, keep)
    assert U.smallest_log2_scale(U.counts_of(torch.tensor([1e-40])), "fp16", log2_range=(0, 10)) is None


def test_largest_scale_matches_real_casts():
    assert U.largest_log2_scale(U.counts_of(torch.tensor([1.5, 1e-9])), "fp16") == 15    # 1.5 * 2**16 -> inf
    # the documented edge: 1.0 * 2**16 = 65536 lies in the binade (2**15, 2**16], judged finite, yet
    # rounds to inf (>= 65520): the answer is one too high only for values landing in [65520, 65536]
    assert U.largest_log2_scale(U.counts_of(torch.tensor([1.0])), "fp16") == 16
    assert H.cast_counts(torch.tensor([1.0]), "fp16", 2.0 ** 16)["overflow"] == 1
    assert U.largest_log2_scale(U.counts_of(torch.tensor([3.0])), "fp16") == 14
    v = log_uniform(5_000, -30, 3, seed=5)
    s = U.largest_log2_scale(U.counts_of(v), "fp16")
    assert H.cast_counts(v, "fp16", 2.0 ** s)["overflow"] == 0
    assert H.cast_counts(v, "fp16", 2.0 ** (s + 1))["overflow"] > 0
    assert U.largest_log2_scale(U.counts_of(torch.tensor([float("inf")])), "fp16") is None


def test_flushed_mass_is_exact():
    v = torch.tensor([2.0 ** -30, -(2.0 ** -30), 2.0 ** -10, 0.0])
    mass = U.flushed_mass([v], [0, 5, 6])
    total = 2 * 2.0 ** -30 + 2.0 ** -10
    np.testing.assert_allclose(mass, [2 * 2.0 ** -30 / total, 2 * 2.0 ** -30 / total, 0.0])


def test_zero_fraction_counts_recorded_zeros():
    model, (x, y) = tiny(), batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = ampviz.Recorder(model, opt)
    zeros = []
    with rec:
        for _ in range(3):
            outs = []

            def keep(module, inputs, output, outs=outs):
                output.retain_grad()
                outs.append(output)
            hooks = [m.register_forward_hook(keep) for m in model if isinstance(m, nn.Linear)]
            F.cross_entropy(model(x), y).backward()
            for h in hooks:
                h.remove()
            zeros.append(sum(int((o.grad == 0).sum()) for o in outs) / sum(o.numel() for o in outs))
            opt.step()
            opt.zero_grad()
            rec.step()
    np.testing.assert_allclose(U.zero_fraction(rec.run), zeros)
    assert zeros[0] > 0                                            # ReLU: inactive units give exact zeros
    with pytest.raises(ValueError, match="kind"):
        U.zero_fraction(rec.run, kind="optimizer")


def test_argument_errors_name_the_argument():
    c = U.counts_of(torch.ones(3))
    with pytest.raises(ValueError, match="keep"):
        U.smallest_log2_scale(c, keep=1.5)
    with pytest.raises(ValueError, match="log2_range"):
        U.largest_log2_scale(c, log2_range=(5, 1))
    with pytest.raises(ValueError, match="counts"):
        U.smallest_log2_scale(np.ones(7))
    with pytest.raises(ValueError, match="format"):
        H.cast_counts(torch.ones(3), "tf32")


def _binade_of(v: float) -> int:
    """Oracle for the closed-at-top binade (2**k, 2**(k+1)] holding v > 0, from numpy's frexp."""
    mantissa, exponent = np.frexp(v)                   # v = mantissa * 2**exponent, mantissa in [0.5, 1)
    return int(exponent) - 2 if mantissa == 0.5 else int(exponent) - 1


def test_median_log2_is_the_binade_of_the_median_magnitude():
    rows, expected = [], []
    for seed, n in ((0, 1001), (1, 999), (2, 4000), (3, 7)):
        v = torch.cat([log_uniform(n, -40, 10, seed=seed), torch.zeros(50)])     # zeros do not count
        mags = np.sort(v.abs().double().numpy()[v.numpy() != 0])
        expected.append(_binade_of(mags[(mags.size + 1) // 2 - 1]))           # the ceil(n/2)-th smallest
        if n % 2:
            assert expected[-1] == _binade_of(float(np.median(mags)))
        rows.append(U.counts_of(v))
    np.testing.assert_array_equal(U.median_log2(np.stack(rows)), expected)
    # an exact power of two lies in the binade below it; an empty row has no median
    assert U.median_log2(U.counts_of(torch.tensor([2.0 ** -25] * 3))) == -26
    assert np.isnan(U.median_log2(U.counts_of(torch.zeros(4))))
    assert U.median_log2(U.counts_of(torch.tensor([1e-40, 1e-40, 1.0]))) == -127     # fp32 subnormals: "below"


def test_zero_share_counts_every_value_in_the_denominator():
    counts = np.stack([U.counts_of(torch.tensor([0.0, 0.0, 1e-30, float("nan")])), np.zeros(H.NBINS, np.int64)])
    np.testing.assert_allclose(U.zero_share(counts), [0.5, 0.0])

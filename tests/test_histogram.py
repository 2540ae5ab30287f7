"""Binade histograms against numpy.frexp, and cast predictions against real casts."""

import math

import numpy as np
import pytest
import torch
from conftest import frexp_columns

from ampviz import _counting
from ampviz import formats as F
from ampviz import histogram as H
from ampviz._counting import cpu_kernels as _binning_numba
from ampviz._counting import ops as _binning


def oracle_counts(values: np.ndarray) -> np.ndarray:
    return np.bincount(frexp_columns(values), minlength=H.NBINS)


def wide_sample(rng, n=50000):
    mags = np.exp2(rng.uniform(-150, 128.5, n))
    with np.errstate(over="ignore"):
        vals = (mags * rng.choice([-1.0, 1.0], n)).astype(np.float32)
    powers = np.ldexp(1.0, np.arange(-149, 128)).astype(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 2.0 ** -126, 2.0 ** -127, 1.5 * 2.0 ** 127,
                        3.0e38, np.finfo(np.float32).max], np.float32)
    return np.concatenate([vals, powers, -powers, special])


def test_fp32_binning_matches_frexp_exactly(rng):
    vals = wide_sample(rng)
    got = H.histogram(torch.from_numpy(vals)).numpy()
    np.testing.assert_array_equal(got, oracle_counts(vals))


def test_every_fp16_bit_pattern_is_binned_exactly():
    pats = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    got = H.histogram(pats).numpy()
    np.testing.assert_array_equal(got, oracle_counts(pats.double().numpy()))
    assert got[H.column(-25)] == 2 * 1          # 2**-24 (min subnormal) lives in (2**-25, 2**-24]


def test_every_bf16_bit_pattern_is_binned_exactly():
    pats = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    got = H.histogram(pats).numpy()
    np.testing.assert_array_equal(got, oracle_counts(pats.double().numpy()))


def test_noncontiguous_and_sparse_inputs(rng):
    x = torch.from_numpy(wide_sample(rng, 4000)).reshape(-1, 2)[:, 1]           # a strided view
    np.testing.assert_array_equal(H.histogram(x).numpy(), oracle_counts(x.numpy()))
    s = torch.sparse_coo_tensor([[0, 3]], [1e-9, 4.0], (10,), check_invariants=True)
    assert H.histogram(s)[H.ZERO] == 0 and H.histogram(s).sum() == 2   # stored values only


@pytest.mark.parametrize("threads", [1, 3])
def test_binner_many_tensors_small_buffer(rng, threads):
    """One buffer far smaller than the tensors: chunked, double-buffered, same counts."""
    tensors = [torch.from_numpy(wide_sample(rng, n)) for n in (5000, 30, 12000)]
    tensors.append(tensors[0].to(torch.bfloat16))
    tensors.append(torch.from_numpy(wide_sample(rng, 3000)).clamp(-6e4, 6e4).half())
    counts = torch.zeros(len(tensors), H.NBINS, dtype=torch.int64)
    b = _counting.Binner("cpu", capacity=4096, max_capacity=4096, threads=threads)
    b.target = counts.view(-1)
    for i, t in enumerate(tensors):
        b.add(t, i)
    b.submit()
    b.close()
    for i, t in enumerate(tensors):
        np.testing.assert_array_equal(counts[i].numpy(), oracle_counts(t.double().numpy()))


def test_binner_grows_instead_of_counting_mid_step_and_groups_small_tensors(rng):
    small = [torch.from_numpy(wide_sample(rng, n)) for n in (7, 300, 1000)]
    big = torch.from_numpy(wide_sample(rng, 20000))
    counts = torch.zeros(4, H.NBINS, dtype=torch.int64)
    b = _counting.Binner("cpu", capacity=4096, threads=2)
    b.target = counts.view(-1)
    b.add(big, 3)
    assert b.capacity >= big.numel() and counts.sum() == 0          # grown, nothing counted yet
    b.add_group(small, [0, 1, 2], _binning.group_offsets([t.numel() for t in small], [0, 1, 2], "cpu"))
    b.submit()
    b.close()
    for i, t in enumerate(small + [big]):
        np.testing.assert_array_equal(counts[i].numpy(), oracle_counts(t.numpy()))


def test_parallel_count_equals_single_thread(rng):
    keys = torch.from_numpy(rng.integers(0, 5 * H.NBINS, 1 << 19)).to(torch.int32)
    one, many = (torch.zeros(5 * H.NBINS, dtype=torch.int64) for _ in range(2))
    for threads, target in ((1, one), (4, many)):
        b = _counting.Binner("cpu", capacity=keys.numel(), threads=threads)
        b.target = target
        b._keys(keys.numel()).copy_(keys)
        b._fill = keys.numel()
        b.submit()
        b.close()
    assert torch.equal(one, many) and one.sum() == keys.numel()


def test_index_add_counting_path_equals_bincount(rng):
    keys = torch.from_numpy(rng.integers(0, 3 * H.NBINS, 10000)).to(torch.int32)
    a = torch.zeros(3 * H.NBINS, dtype=torch.int64)
    b = torch.zeros_like(a)
    _binning._count_cpu(keys, a)
    _binning._count_index_add(keys, b)          # the CUDA path (no host sync), run here on CPU
    assert torch.equal(a, b)


def test_histograms_rejects_non_float():
    with pytest.raises(TypeError, match=r"tensors\[1\]: expected a floating-point or complex tensor, got torch.int64"):
        H.histograms([torch.ones(2), torch.ones(2, dtype=torch.int64)])


# ----------------------------------------------------------------------------- cast predictions
FORMATS = [F.FP16, F.BF16, F.FP8_E4M3FN, F.FP8_E5M2, F.TF32, F.FP32]


def actual_fates(x: torch.Tensor, fmt, log2_scale: int) -> dict:
    scaled = x.double() * 2.0 ** log2_scale                   # exact for powers of two
    y = fmt.round(scaled.float()).double()                    # a real cast
    a = scaled.abs()
    was_zero, was_nan = a == 0, torch.isnan(a)
    nz = ~was_zero & ~was_nan
    ya = y.abs()
    overflow = nz & (torch.isinf(ya) | ((ya == fmt.max) & (a > fmt.overflow_threshold)) |
                     ((ya == fmt.max) & (a == fmt.overflow_threshold) & fmt.saturates & False))
    return {"zero": int(was_zero.sum()), "nan": int(was_nan.sum()),
            "flushed": int((nz & (ya == 0)).sum()),
            "subnormal": int((nz & (ya > 0) & (ya < fmt.min_normal)).sum()),
            "normal": int((nz & (ya >= fmt.min_normal) & ~overflow).sum()),
            "overflow": int(overflow.sum())}


def edge_sets(x: torch.Tensor, fmt, log2_scale: int):
    a = x.double().abs() * 2.0 ** log2_scale
    e1 = (a >= fmt.min_normal - fmt.min_subnormal / 2) & (a <= fmt.min_normal)
    top = 2.0 ** (fmt.emax + 1)
    e2 = ((a > fmt.overflow_threshold) if fmt.overflow_tie_rounds_down else (a >= fmt.overflow_threshold)) & (a <= top)
    return int(e1.sum()), int(e2.sum())


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_fate_matches_real_casts_except_documented_edges(fmt, rng):
    vals = np.exp2(rng.uniform(-60, 40, 20000)) * rng.choice([-1, 1], 20000)
    x = torch.from_numpy(np.concatenate([vals, [0.0, np.nan]])).float()
    # put values right on the edges so the edge sets are exercised, not empty by luck
    for s in (-20, -8, 0, 7, 16, 24):
        edges = torch.tensor([fmt.min_subnormal / 2, fmt.min_subnormal * 0.75, fmt.min_normal,
                              fmt.min_normal - fmt.min_subnormal / 4, fmt.overflow_threshold,
                              fmt.max, 2.0 ** (fmt.emax + 1)], dtype=torch.float64) / 2.0 ** s
        xs = torch.cat([x, edges.float()])
        a = xs.double().abs()
        xs = xs[(a == 0) | a.isnan() | ((a > 2.0 ** -126) & (a <= 2.0 ** 127))]   # see test_below_and_above
        counts = H.histogram(xs).numpy()
        got = H.fate(counts, fmt, log2_scale=s)
        want = actual_fates(xs, fmt, s)
        e1, e2 = edge_sets(xs, fmt, s)
        assert got.zero == want["zero"] and got.nan == want["nan"]
        assert got.flushed == want["flushed"], (fmt.name, s)          # exact, ties included
        # subnormal vs normal differ by exactly the first edge set, normal vs overflow by the second
        assert got.subnormal - want["subnormal"] == e1, (fmt.name, s)
        assert want["overflow"] - got.overflow == e2, (fmt.name, s)
        assert got.normal - want["normal"] == e2 - e1, (fmt.name, s)


def test_below_and_above_columns_are_judged_by_their_edges():
    below = torch.tensor([2.0 ** -130, 2.0 ** -140])        # fp32 subnormals / bf16 subnormals
    h = H.histogram(below).numpy()
    assert h[H.BELOW] == 2
    assert H.fate(h, "fp16", 1.0).flushed == 2              # exact: everything <= 2**-126 flushes in fp16
    assert H.fate(h, "bf16", 1.0).subnormal == 2            # judged by 2**-126: 2**-140 really flushes
    assert H.fate(H.histogram(torch.tensor([3e38])).numpy(), "fp32", 1.0).overflow == 1   # documented


def test_fp16_flush_boundary_is_exact_at_the_tie():
    x = torch.tensor([2.0 ** -25, 2.0 ** -25 * (1 + 2 ** -20), 2.0 ** -26])
    f = H.fate(H.histogram(x).numpy(), "fp16", 1.0)
    assert (f.flushed, f.subnormal) == (2, 1)
    assert (x.half() == 0).tolist() == [True, False, True]


def test_fate_is_vectorised_and_fractions():
    counts = np.stack([H.histogram(torch.tensor([1e-9, 1.0])).numpy(), H.histogram(torch.tensor([0.0, 7e4])).numpy()])
    f = H.fate(counts, "fp16", 1.0)
    assert f.flushed.tolist() == [1, 0] and f.overflow.tolist() == [0, 1]
    assert f.fraction("flushed").tolist() == [0.5, 0.0] and f.zero.tolist() == [0, 1]
    table = H.fate_table(counts, "fp16", [0, 10, 20])
    assert table["flushed"].shape == (3, 2) and table["flushed"][:, 0].tolist() == [1, 0, 0]
    assert table["overflow"][:, 0].tolist() == [0, 0, 1]


def test_fate_rejects_non_power_of_two_scale():
    with pytest.raises(ValueError, match="scale: .*powers of two.*2\\*\\*10"):
        H.fate(np.zeros(H.NBINS), "fp16", 1000.0)
    with pytest.raises(ValueError, match="counts: expected an array whose last axis has 257 bins"):
        H.fate(np.zeros(10), "fp16", 1.0)


def test_max_magnitude_and_shift():
    h = H.histogram(torch.tensor([0.0, 3.0, 1e-3])).numpy()
    assert H.max_magnitude(h) == 4.0
    assert H.max_magnitude(H.histogram(torch.tensor([1.0, math.inf])).numpy()) == math.inf
    assert H.max_magnitude(np.zeros(H.NBINS, dtype=np.int64)) == 0.0
    x = torch.tensor([3.0, 1e-3, 0.0, math.nan])
    for s in (-5, 0, 9):
        np.testing.assert_array_equal(H.shift(H.histogram(x).numpy(), s), H.histogram(x * 2.0 ** s).numpy())
    per_row = H.shift(np.stack([H.histogram(x).numpy()] * 2), np.array([1, -1]))
    np.testing.assert_array_equal(per_row[1], H.histogram(x / 2).numpy())
    assert H.shift(H.histogram(torch.tensor([1e30])).numpy(), 200)[H.ABOVE] == 1


def test_labels_and_edges_agree():
    lo, hi, labels = H.lower_edges(), H.upper_edges(), H.bin_labels()
    assert len(labels) == H.NBINS and labels[H.column(-24)] == "(2^-24,2^-23]"
    assert lo[H.column(-24)] == 2.0 ** -24 and hi[H.column(-24)] == 2.0 ** -23


@pytest.mark.skipif(not _binning_numba.available(), reason="numba is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_numba_counter_equals_torch_binner(rng, dtype):
    vals = torch.from_numpy(wide_sample(rng, 1 << 21 if dtype == torch.float32 else 30000))
    if dtype == torch.float16:
        vals = vals.clamp(-6e4, 6e4)
    x = vals.to(dtype)
    a, b = (torch.zeros(2, H.NBINS, dtype=torch.int64) for _ in range(2))
    numba = _binning_numba.NumbaCounter(threads=2, min_share=1 << 12)
    for counter, target in ((numba, a), (_counting.Binner("cpu"), b)):
        counter.target = target.view(-1)
        counter.add(x, 1)
        counter.add(x[::3], 0)                  # a strided view too
        counter.submit()
        counter.close()
    assert torch.equal(a, b) and a[1].sum() == x.numel()


@pytest.mark.skipif(not _binning_numba.available(), reason="numba is not installed")
def test_numba_counts_split_over_threads_equal_one_thread(rng):
    tensors = [torch.from_numpy(wide_sample(rng, n)) for n in (70000, 5, 40000, 123457)]
    tensors += [tensors[0].bfloat16(), tensors[2].clamp(-6e4, 6e4).half(), tensors[3].double()]
    rows = [0, 1, 1, 2, 3, 4, 5]                          # two tensors share a row
    one, many = (torch.zeros(6, H.NBINS, dtype=torch.int64) for _ in range(2))
    for target, counter in ((one, _binning_numba.NumbaCounter(threads=1)),
                            (many, _binning_numba.NumbaCounter(threads=3, min_share=1000))):
        counter.target = target.view(-1)
        counter.add_many(tensors, rows)
        counter.add(tensors[3], 5)                        # one tensor, split in three
        counter.close()
    assert torch.equal(one, many) and one.sum() == sum(t.numel() for t in tensors) + tensors[3].numel()


def test_make_counter_falls_back_to_torch_without_numba(monkeypatch):
    monkeypatch.setattr(_binning_numba, "njit", None)
    assert isinstance(_counting.make_counter("cpu"), _counting.Binner)
    np.testing.assert_array_equal(H.histogram(torch.tensor([0.0, 1.0, 3.0])).numpy()[[0, 127, 129]], [1, 1, 1])


# ----------------------------------------------------------------------------- complex and fp64 (issue 12, item 13)
def counter_paths():
    paths = [lambda: _counting.Binner("cpu", capacity=4096)]
    if _binning_numba.available():
        paths.append(lambda: _binning_numba.NumbaCounter(threads=2, min_share=2))
    return paths


@pytest.mark.parametrize("make", counter_paths(), ids=lambda m: type(m()).__name__)
def test_complex_values_are_counted_by_their_magnitude_on_every_path(make):
    z = torch.tensor([3e-30 + 4j, 1j, 0j, complex("nan+1j")], dtype=torch.complex64)
    counts = torch.zeros(1, H.NBINS, dtype=torch.int64)
    c = make()
    c.target = counts.view(-1)
    c.add(z, 0)
    c.submit()
    c.close()
    expected = oracle_counts(np.abs(z.numpy()))
    np.testing.assert_array_equal(counts[0].numpy(), expected)
    assert np.flatnonzero(expected).tolist() == [H.ZERO, H.column(-1), H.column(1), H.NAN]   # |1j| = 1, |.| = 4
    np.testing.assert_array_equal(H.histogram(z).numpy(), expected)
    np.testing.assert_array_equal(H.histogram(z.to(torch.complex128)).numpy(), expected)


def test_a_complex_parameter_is_recorded_by_the_magnitude_of_its_gradient():
    import ampviz
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(50, dtype=torch.complex64))
    model = torch.nn.Module()
    model.w = w
    opt = torch.optim.SGD([w], lr=0.1)
    with ampviz.Recorder(model, opt, activations=False) as rec:
        (w * w.conj()).real.sum().backward()
        expected = H.histogram(w.grad.abs()).numpy()
        opt.step()
        rec.step()
    np.testing.assert_array_equal(rec.run.counts[0, 0, 0], expected)


@pytest.mark.parametrize("make", counter_paths(), ids=lambda m: type(m()).__name__)
def test_fp64_beyond_fp32s_range_is_counted_below_or_above_exactly(make, rng):
    tiny = np.array([1e-300, 5e-324, 2.0 ** -150, 2.0 ** -127, -1e-46])
    huge = np.array([1e300, np.inf, 2.0 ** 128])
    edges = np.ldexp(1 + 2.0 ** -40, np.arange(-120, 120, 7))       # just above a power of two: fp32 rounds it down
    vals = np.concatenate([tiny, huge, edges, -edges, np.exp2(rng.uniform(-1070, 1020, 20000)), [0.0, np.nan]])
    counts = torch.zeros(1, H.NBINS, dtype=torch.int64)
    c = make()
    c.target = counts.view(-1)
    c.add(torch.from_numpy(vals), 0)
    c.submit()
    c.close()
    np.testing.assert_array_equal(counts[0].numpy(), oracle_counts(vals))
    h = H.histogram(torch.from_numpy(tiny)).numpy()
    assert h[H.BELOW] == tiny.size and h[H.ZERO] == 0               # none of them is zero

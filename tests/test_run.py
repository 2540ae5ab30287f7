"""Run files: round trips, atomic writes, clear errors for bad files, rank merging, domains."""

import json
import os
import re
import stat
import zipfile
from dataclasses import replace

import numpy as np
import pytest
import torch

from ampviz import histogram as H
from ampviz._warnings import AmpvizWarning
from ampviz.run import Run, RunFileError


def make_run(rank=0, steps=6, tensors=("w", "act"), scale_log2=(16, 16, 15, 15, 15, 16), world=1):
    rng = np.random.default_rng(rank)
    T = len(tensors)
    counts = np.zeros((1, steps, T, H.NBINS), dtype=np.int64)
    for h in range(steps):
        for t in range(T):
            vals = torch.from_numpy(np.exp2(rng.uniform(-30, -5, 100))).float()
            counts[0, h, t] = H.histogram(vals).numpy()
    scale = np.exp2(np.asarray(scale_log2, dtype=float))[None]
    nxt = np.concatenate([scale[:, 1:], scale[:, -1:]], axis=1)
    return Run(np.arange(steps), rng.random((1, steps)), scale, nxt, nxt < scale, np.arange(steps), counts,
               list(tensors), ["weight", "activation"][:T], ["torch.float32", "torch.float16"][:T],
               {"world_size": world, "ranks": [rank], "every": 1,
                "domains": {"weight": "unscaled", "activation": "scaled"}})


def test_round_trip(tmp_path):
    run = make_run()
    [path] = run.save(tmp_path / "run")
    assert path.name == "run.npz" and [p.name for p in tmp_path.iterdir()] == ["run.npz"]   # no temp left
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask          # not mkstemp's private 0600
    back = Run.load(path)
    for name in ("steps", "loss", "loss_scale", "next_scale", "skipped", "hist_steps", "counts"):
        np.testing.assert_array_equal(getattr(back, name), getattr(run, name))
    assert back.tensor_names == run.tensor_names and back.meta["domains"] == run.meta["domains"]
    with np.load(path, allow_pickle=False) as z:       # readable without pickle
        assert json.loads(str(z["meta"][()]))["schema"] == 1


def test_skipped_and_grown_from_scales():
    run = make_run()
    assert run.skipped[0].tolist() == [False, True, False, False, False, False]
    assert run.grown[0].tolist() == [False, False, False, False, True, False]


def test_domains_shift_by_the_loss_scale():
    run = make_run()
    sc = run.counts_in("scaled")
    un = run.counts_in("unscaled")
    # weights are stored unscaled, activations scaled: the other view shifts by log2(scale) per step
    np.testing.assert_array_equal(un[:, :, 0], run.counts[:, :, 0])
    np.testing.assert_array_equal(sc[:, :, 1], run.counts[:, :, 1])
    np.testing.assert_array_equal(sc[0, 2, 0], H.shift(run.counts[0, 2, 0], 15))
    np.testing.assert_array_equal(un[0, 0, 1], H.shift(run.counts[0, 0, 1], -16))
    np.testing.assert_array_equal(run.histogram(3, "act", domain="unscaled"), un[0, 3, 1])
    with pytest.raises(ValueError, match="domain: expected one of"):
        run.counts_in("raw")


def test_directory_of_ranks_merges_with_a_rank_axis(tmp_path):
    for r in (1, 0):
        make_run(rank=r, world=2).save(tmp_path / f"rank{r}.npz")
    run = Run.load(tmp_path)
    assert run.ranks == [0, 1] and run.counts.shape == (2, 6, 2, H.NBINS)
    assert not np.array_equal(run.loss[0], run.loss[1])
    one = run.select(rank=1)
    assert one.ranks == [1] and np.array_equal(one.loss[0], run.loss[1])
    paths = run.save(tmp_path / "copy")
    assert sorted(p.name for p in paths) == ["rank0.npz", "rank1.npz"]


def test_missing_rank_and_short_rank_warn(tmp_path):
    make_run(rank=0, world=2).save(tmp_path / "rank0.npz")
    with pytest.warns(AmpvizWarning, match="1 of 2 ranks"):
        Run.load(tmp_path)
    short = make_run(rank=1, world=2, steps=4, scale_log2=(16, 16, 15, 15))
    short.save(tmp_path / "rank1.npz")
    with pytest.warns(AmpvizWarning, match="keeping the first 4"):
        run = Run.load(tmp_path)
    assert run.n_steps == 4


def test_tidy_views():
    df = make_run().to_pandas()
    assert set(df.columns) == {"rank", "step", "tensor", "kind", "bin", "lo", "hi", "count"}
    assert df["count"].sum() == 6 * 2 * 100 and (df["count"] > 0).all()
    s = make_run().scalars_to_pandas()
    assert len(s) == 6 and s["skipped"].sum() == 1 and s["grown"].sum() == 1


def test_bad_files_give_clear_errors(tmp_path):
    good = make_run().save(tmp_path / "good.npz")[0]
    data = good.read_bytes()
    (tmp_path / "trunc.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(RunFileError, match="trunc.npz: not a readable ampviz run file"):
        Run.load(tmp_path / "trunc.npz")
    (tmp_path / "junk.npz").write_bytes(b"hello, not a zip")
    with pytest.raises(RunFileError, match="junk.npz: not a readable ampviz run file \\(not a complete .npz"):
        Run.load(tmp_path / "junk.npz")
    np.savez(tmp_path / "foreign.npz", x=np.arange(3))
    with pytest.raises(RunFileError, match="foreign.npz: not an ampviz run"):
        Run.load(tmp_path / "foreign.npz")
    with pytest.raises(RunFileError, match="nothere.npz: no such file"):
        Run.load(tmp_path / "nothere.npz")
    # a newer schema
    with np.load(good) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays["meta"][()]))
    meta["schema"] = 99
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez(tmp_path / "newer.npz", **arrays)
    with pytest.raises(RunFileError, match="newer.npz: written by a newer ampviz \\(schema 99 > 2\\)"):
        Run.load(tmp_path / "newer.npz")
    # an object array would need pickle: refused
    arrays["meta"] = np.array([{"a": 1}], dtype=object)
    np.savez(tmp_path / "pickled.npz", **arrays)
    with pytest.raises(RunFileError, match="pickled.npz"):
        Run.load(tmp_path / "pickled.npz")
    # inconsistent shapes
    meta["schema"] = 1
    arrays["meta"] = np.array(json.dumps(meta))
    arrays["counts"] = arrays["counts"][:, :1]
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(RunFileError, match="bad.npz: .*corrupt run: counts has shape"):
        Run.load(tmp_path / "bad.npz")
    with zipfile.ZipFile(tmp_path / "missing.npz", "w") as z:
        z.writestr("meta.npy", (tmp_path / "x").name)
    with pytest.raises(RunFileError, match="missing.npz"):
        Run.load(tmp_path / "missing.npz")


def test_failed_save_leaves_the_old_file(tmp_path, monkeypatch):
    path = make_run().save(tmp_path / "r.npz")[0]
    before = path.read_bytes()

    def boom(*a, **k):                                  # the members are written, then the disk fills
        raise OSError("disk full")
    monkeypatch.setattr("ampviz.run._write._write_directory", boom)
    with pytest.raises(OSError, match="disk full"):
        make_run(rank=0, steps=3, scale_log2=(1, 1, 1)).save(path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["r.npz"]


def test_lookup_errors():
    run = make_run()
    with pytest.raises(KeyError, match="no tensor named 'nope'"):
        run.tensor_index("nope")
    with pytest.raises(KeyError, match="step: 99 has no histogram"):
        run.hist_index(99)
    with pytest.raises(KeyError, match="rank: 3 not in this run"):
        run.select(rank=3)


def test_summary_names_a_worst_tensor_only_when_something_is_lost():
    s = make_run().summary("bf16")        # 2**-30 .. 2**-5 values: nothing flushes or overflows in bf16
    assert (s["worst_flushed_fraction"], s["worst_flushed_tensor"]) == (0.0, None)
    assert (s["worst_overflow_fraction"], s["worst_overflow_tensor"]) == (0.0, None)
    s16 = make_run().summary("fp16")
    assert s16["worst_flushed_fraction"] > 0 and s16["worst_flushed_tensor"] in ("w", "act")


def test_optional_arrays_round_trip_select_and_merge(tmp_path):
    R, N, T = 1, 4, 3

    def one(rank):
        order = np.tile(np.array([2, 0, -1], dtype=np.int32), (R, N, 1))
        return Run(np.arange(N), np.zeros((R, N)), np.ones((R, N)), np.ones((R, N)), np.zeros((R, N), bool),
                   np.arange(N), np.zeros((R, N, T, H.NBINS), np.int64), ["a", "b", "c"],
                   ["weight", "activation", "output"], ["", "", ""], {"ranks": [rank], "world_size": 2},
                   grad_order=order, scheduler_steps=np.arange(N)[None] + rank)
    for rank in (0, 1):
        one(rank).save(tmp_path / f"rank{rank}.npz")
    run = Run.load(tmp_path)
    assert run.grad_order.shape == (2, N, T) and run.grad_order[1, 0].tolist() == [2, 0, -1]
    assert run.scheduler_steps.tolist() == [[0, 1, 2, 3], [1, 2, 3, 4]]
    picked = run.select(rank=1, tensors=["c", "a"])
    assert picked.grad_order.tolist() == [[[-1, 2]] * N] and picked.scheduler_steps.tolist() == [[1, 2, 3, 4]]
    plain = replace(one(0), grad_order=None, scheduler_steps=None)
    plain.save(tmp_path / "plain.npz")
    assert Run.load(tmp_path / "plain.npz").grad_order is None
    with pytest.raises(RunFileError, match="grad_order has shape"):
        replace(one(0), grad_order=np.zeros((1, N), np.int32))


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp8_e4m3fn"])
@pytest.mark.parametrize("domain", ["scaled", "unscaled", "recorded"])
def test_fate_in_a_domain_equals_the_fate_of_the_shifted_copy(fmt, domain):
    run = Run.merge([make_run(rank=0, world=2), make_run(rank=1, world=2, scale_log2=(20, 3, 3, 9, 9, 9))])
    got, expected = run.fate_in(fmt, domain), H.fate(run.counts_in(domain), fmt, 1.0)
    for field in ("zero", "flushed", "subnormal", "normal", "overflow", "nan"):
        np.testing.assert_array_equal(getattr(got, field), getattr(expected, field), err_msg=field)


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp32", "fp8_e4m3fn", "fp8_e5m2"])
def test_fate_rows_judges_each_row_at_its_own_scale_like_histogram_fate(fmt, rng):
    from ampviz.histogram import fate_rows
    counts = rng.integers(0, 5, (300, H.NBINS))                       # every column, specials included
    scales = rng.integers(-140, 140, 300)
    got = fate_rows(counts, fmt, scales)
    for i in range(300):
        expected = H.fate(counts[i], fmt, log2_scale=int(scales[i]))
        assert {f: int(v[i]) for f, v in got.items()} == {f: int(getattr(expected, f)) for f in got}, (i, scales[i])


def test_a_rank_saved_in_parts_loads_beside_a_shorter_rank(tmp_path):
    """A periodically saved rank whose last part holds one row the shorter rank lacks: that part is skipped,
    not read into an empty slice (the directory once failed to load as 'counts ... more data than its header
    declares' when a rank was killed one step after a save)."""
    from ampviz.run._write import RunFileWriter
    longer = make_run(rank=0, world=2, steps=7, scale_log2=(16, 16, 15, 15, 15, 16, 16))
    arrays, meta = longer._rank_payload(0)
    writer = RunFileWriter(tmp_path / "rank0.npz")
    for start, stop in ((0, 3), (3, 6), (6, 7)):                 # parts of 3, 3 and 1 rows
        part = {name: arr[start:stop] for name, arr in arrays.items()}
        writer.save(meta, full=lambda part=part: part, tail=lambda part=part: part, rewrite=False)
    assert writer.parts == 3
    make_run(rank=1, world=2, steps=6, scale_log2=(16, 16, 15, 15, 15, 16)).save(tmp_path / "rank1.npz")
    with pytest.warns(AmpvizWarning, match="keeping the first 6"):
        run = Run.load(tmp_path)
    assert run.n_steps == 6
    np.testing.assert_array_equal(run.counts[0], longer.counts[0, :6])
    np.testing.assert_array_equal(Run.load(tmp_path / "rank0.npz").counts, longer.counts)


# ---------------------------------------------------------------- the read API: rank ids, one domain default, kinds
def two_ranks():
    """A 2-rank run whose rank ids (1, 3) are not their positions (0, 1), each rank with its own scales: ranks 1
    and 3 of a 4-rank job."""
    with pytest.warns(AmpvizWarning, match=r"2 of 4 ranks found: \[1, 3\]"):
        return Run.merge([make_run(rank=3, world=4, scale_log2=(20, 3, 3, 9, 9, 9)), make_run(rank=1, world=4)])


def test_a_run_s_ranks_can_be_ids_that_are_not_positions():
    run = two_ranks()
    assert run.ranks == [1, 3] and run.rank_index(3) == 1
    assert not np.array_equal(run.counts[0], run.counts[1]) and not np.array_equal(run.loss_scale[0],
                                                                                  run.loss_scale[1])


@pytest.mark.parametrize("domain", ["unscaled", "scaled", "recorded"])
def test_every_reader_takes_rank_as_an_id(domain):
    run = two_ranks()
    full = run.counts_in(domain)                                                     # (R, H, T, NBINS)
    for pos, rank in enumerate(run.ranks):
        np.testing.assert_array_equal(run.counts_for(domain, rank=rank), full[pos])
        np.testing.assert_array_equal(run.tensor_counts("act", domain, rank=rank), full[pos, :, 1])
        np.testing.assert_array_equal(run.pooled_counts(domain, rank=rank), full[pos].sum(axis=1))
        np.testing.assert_array_equal(run.counts_at(2, domain, rank=rank), full[pos, 2])
        np.testing.assert_array_equal(run.histogram(4, "w", rank=rank, domain=domain), full[pos, 4, 0])
    # rank 1 is the first rank, at position 0; rank 3 at position 1 (by id, not by position)
    np.testing.assert_array_equal(run.tensor_counts("w", domain, rank=3), full[1, :, 0])
    # the default is the first rank
    np.testing.assert_array_equal(run.pooled_counts(domain), full[0].sum(axis=1))
    np.testing.assert_array_equal(run.histogram(4, "act", domain=domain), full[0, 4, 1])


@pytest.mark.parametrize("reader", [
    lambda run, **kw: run.counts_for("scaled", **kw),
    lambda run, **kw: run.tensor_counts("w", "scaled", **kw),
    lambda run, **kw: run.pooled_counts("scaled", **kw),
    lambda run, **kw: run.counts_at(0, "scaled", **kw),
    lambda run, **kw: run.histogram(0, "w", **kw),
], ids=["counts_for", "tensor_counts", "pooled_counts", "counts_at", "histogram"])
def test_a_rank_position_is_not_a_rank_id(reader):
    run = two_ranks()
    with pytest.raises(KeyError, match=r"rank: 0 not in this run; ranks: \[1, 3\]"):
        reader(run, rank=0)                         # position 0 holds rank 1: 0 is no rank id here


def test_the_positional_rank_index_still_works_deprecated():
    run = two_ranks()
    full = run.counts_in("scaled")
    with pytest.warns(DeprecationWarning, match=r"rank_index .* is deprecated; pass rank= with a rank id, one of "
                                                r"\[1, 3\]"):
        got = run.pooled_counts("scaled", 1)       # the old call: position 1 (rank 3)
    np.testing.assert_array_equal(got, full[1].sum(axis=1))
    with pytest.warns(DeprecationWarning):
        np.testing.assert_array_equal(run.tensor_counts("act", "scaled", 1), full[1, :, 1])
    with pytest.warns(DeprecationWarning):
        np.testing.assert_array_equal(run.counts_at(3, "scaled", rank_index=0), full[0, 3])
    with pytest.raises(TypeError, match="tensor_counts: pass rank= .* or rank_index= .*, not both"):
        run.tensor_counts("w", "scaled", 0, rank=1)
    with pytest.warns(DeprecationWarning), pytest.raises(IndexError, match="rank_index: 2 is not a position among 2"):
        run.counts_at(0, "scaled", 2)


@pytest.mark.parametrize("domain", ["unscaled", "scaled", "recorded"])
def test_counts_for_selects_like_slicing_counts_in(domain):
    run = two_ranks()
    full = run.counts_in(domain)                                                     # (R, H, T, NBINS)
    np.testing.assert_array_equal(run.counts_for(domain), full)
    np.testing.assert_array_equal(run.counts_for(domain, step=3), full[:, 3])
    np.testing.assert_array_equal(run.counts_for(domain, tensors="act"), full[:, :, 1])
    np.testing.assert_array_equal(run.counts_for(domain, tensors=["act", 0]), full[:, :, [1, 0]])
    np.testing.assert_array_equal(run.counts_for(domain, kind="weight"), full[:, :, [0]])
    np.testing.assert_array_equal(run.counts_for(domain, pooled=True), full.sum(axis=2))
    np.testing.assert_array_equal(run.counts_for(domain, rank=3, step=5, tensors="w"), full[1, 5, 0])
    np.testing.assert_array_equal(run.counts_for(domain, rank=1, step=2, pooled=True), full[0, 2].sum(axis=0))
    np.testing.assert_array_equal(run.counts_for(domain, rank=3, kind="activation", pooled=True),
                                  full[1][:, [1]].sum(axis=1))
    out = run.counts_for(domain, rank=1)
    out[...] = -1                                                        # a copy: the run's counts are untouched
    assert (run.counts >= 0).all()


def test_every_reader_defaults_to_the_unscaled_domain():
    import inspect
    run = two_ranks()
    for name in ("counts_for", "counts_in", "tensor_counts", "pooled_counts", "counts_at", "histogram", "fate_in",
                 "to_pandas"):
        assert inspect.signature(getattr(run, name)).parameters["domain"].default == "unscaled", name
    np.testing.assert_array_equal(run.counts_for(), run.counts_in("unscaled"))
    np.testing.assert_array_equal(run.pooled_counts(), run.pooled_counts("unscaled"))
    np.testing.assert_array_equal(run.histogram(4, "act"), run.counts_in("unscaled")[0, 4, 1])
    # fate_in's default changed from "scaled": here the two differ (the activations' scaled values overflow fp16)
    default, unscaled, scaled = run.fate_in("fp16"), run.fate_in("fp16", "unscaled"), run.fate_in("fp16", "scaled")
    np.testing.assert_array_equal(default.flushed, unscaled.flushed)
    np.testing.assert_array_equal(default.overflow, unscaled.overflow)
    assert not np.array_equal(default.flushed, scaled.flushed)


def test_tensors_of_selects_by_kind():
    kinds = ["weight", "activation", "output", "weight"]
    run = Run(np.arange(2), np.zeros((1, 2)), np.ones((1, 2)), np.ones((1, 2)), np.zeros((1, 2), bool), np.arange(2),
              np.zeros((1, 2, 4, H.NBINS), np.int64), ["a", "b", "c", "d"], kinds, [""] * 4, {"ranks": [0]})
    assert run.tensors_of("weight") == [0, 3] and run.tensors_of("output") == [2]
    assert run.tensors_of("weight_local") == []                           # a kind this run did not record
    assert run.tensors_of(("activation", "weight")) == [0, 1, 3]          # recording order, not the tuple's
    assert run.tensors_of({"output"}) == [2]
    assert run.tensor_indices(kind="weight") == run.tensors_of("weight")
    for bad in ("gradient", ["weight", "grad"], [], 3, None):
        with pytest.raises(ValueError, match=r"kind: expected one of \['weight', 'activation', 'weight_local', "
                                             r"'output'\] \(or a list of them\), got " + re.escape(repr(bad))):
            run.tensors_of(bad)


def test_read_errors_name_the_argument_the_value_and_what_is_valid():
    run = two_ranks()
    with pytest.raises(ValueError, match=r"domain: expected one of .*'unscaled'.*'scaled'.*'recorded'.*got 'raw'"):
        run.counts_for("raw")
    with pytest.raises(ValueError, match=r"domain: expected one of .*got 'raw'"):
        run.fate_in("fp16", "raw")
    with pytest.raises(ValueError, match=r"kind: expected one of \['activation', 'weight'\] or None, got 'output'"):
        run.counts_for(kind="output")
    with pytest.raises(KeyError, match="step: 99 has no histogram"):
        run.counts_for(step=99)
    with pytest.raises(KeyError, match="tensor: no tensor named 'nope'; recorded: w, act"):
        run.counts_for(tensors=["w", "nope"])
    with pytest.raises(ValueError, match="pooled: a single tensor \\('w'\\) has nothing to sum"):
        run.counts_for(tensors="w", pooled=True)
    with pytest.raises(TypeError, match="pooled: expected True or False, got 'yes'"):
        run.counts_for(pooled="yes")
    with pytest.raises(ValueError, match=r"tensors: the selection \[\] is empty"):
        run.counts_for(tensors=[])

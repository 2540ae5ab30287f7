"""ampviz.export: what TensorBoard and W&B store, read back with their own readers, equals the run's counts."""

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _oracles import read_tensorboard, tensorboard_row, wandb_history, wandb_row

import ampviz
import ampviz.histogram as H
from ampviz.cli import main
from ampviz.export import LiveExport, log2_buckets, to_tensorboard, to_wandb


def record(dtype=torch.float16, steps=8, seed=0, loss_factor=1.0):
    """A real recorded run: ReLU zeros, and with fp16 an init scale high enough to overflow (skips, inf)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 21) if dtype is torch.float16 else None
    rec = ampviz.Recorder(model, opt, scaler=scaler)
    with rec:
        for _ in range(steps):
            x, y = torch.randn(8, 16), torch.randn(8, 4)
            with torch.amp.autocast("cpu", dtype=dtype):
                loss = F.mse_loss(model(x).float(), y) * loss_factor
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad(set_to_none=True)
            rec.step(loss)
    return rec.run


@pytest.fixture(scope="module")
def fp16_run():
    run = record()
    assert run.skipped[0].any() and not run.skipped[0].all()                 # the test covers both kinds of step
    assert run.counts[..., H.ZERO].sum() > 0 and run.counts[..., H.ABOVE].sum() > 0
    return run


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                        "WANDB_CONFIG_DIR": str(tmp_path / "config"), "WANDB_CACHE_DIR": str(tmp_path / "cache"),
                        "WANDB_DATA_DIR": str(tmp_path / "data")}.items():
        monkeypatch.setenv(name, value)
    wandb = pytest.importorskip("wandb")
    wandb.teardown()                   # W&B reads its settings once per process: start from this test's
    yield tmp_path
    wandb.teardown()


def assert_tensorboard_holds(acc, run, rank_index=0, domain="recorded", prefix="ampviz"):
    for h, step in enumerate(run.hist_steps.tolist()):
        counts = run.counts_at(h, domain, rank=run.ranks[rank_index])
        for t, (name, kind) in enumerate(zip(run.tensor_names, run.tensor_kinds)):
            np.testing.assert_array_equal(tensorboard_row(acc, prefix, kind, name, step), counts[t],
                                          err_msg=f"{name} at step {step}")
    for key, values in (("loss", run.loss), ("loss_scale", run.loss_scale), ("skipped", run.skipped)):
        events = acc.Scalars(f"{prefix}/{key}")
        assert [e.step for e in events] == run.steps.tolist()
        np.testing.assert_array_equal([e.value for e in events], values[rank_index].astype(np.float32))


def test_log2_buckets_keep_every_finite_count_and_the_below_bucket_starts_at_the_smallest_subnormal():
    row = H.histogram(torch.tensor([0.0, 2.0 ** -140, 2.0 ** -126, 3.0, float("inf"), float("nan")])).numpy()
    edges, counts = log2_buckets(row)
    assert edges[0] == -149 and edges[1] == -126 and edges[-1] == 2           # 3.0 is in (2^1, 2^2]
    assert counts.sum() == 3 and counts[0] == 2 and counts[-1] == 1
    assert log2_buckets(H.histogram(torch.zeros(4)).numpy()) is None


def test_tensorboard_reads_back_the_exact_counts_and_scalars(tmp_path, fp16_run):
    written = to_tensorboard(fp16_run, tmp_path / "tb")
    assert written == [tmp_path / "tb"]
    acc = read_tensorboard(tmp_path / "tb")
    assert_tensorboard_holds(acc, fp16_run)
    assert "ampviz/about/text_summary" in acc.Tags()["tensors"]           # the domains and axis, as text


def test_tensorboard_in_the_unscaled_domain(tmp_path, fp16_run):
    to_tensorboard(fp16_run, tmp_path / "tb", domain="unscaled")
    assert_tensorboard_holds(read_tensorboard(tmp_path / "tb"), fp16_run, domain="unscaled")


def test_bf16_gradients_beyond_the_fp16_range_survive_the_export(tmp_path):
    run = record(torch.bfloat16, steps=3, loss_factor=2.0 ** 24)             # bf16 activation gradients > 65504
    act = run.tensors_of("activation")
    assert run.counts[0][:, act, H.column(16):H.ABOVE].sum() > 0
    to_tensorboard(run, tmp_path / "tb")
    assert_tensorboard_holds(read_tensorboard(tmp_path / "tb"), run)


def test_torch_add_histogram_casts_bf16_to_fp16_first():
    # torch 2.13: SummaryWriter.add_histogram (torch.utils.tensorboard.summary.histogram) casts a bf16 tensor to fp16
    # before binning, so a bf16 gradient beyond fp16's 65504 turns to inf and no summary can be made of it; the
    # export above writes ampviz's own bins instead (docs/integrations.md cites this test)
    from torch.utils.tensorboard.summary import histogram
    beyond = torch.tensor([1.0, 2.0 ** 20], dtype=torch.bfloat16)
    assert histogram("g", beyond.float(), bins=4).value[0].histo.max == 2.0 ** 20
    with pytest.raises(ValueError, match="not finite"):
        histogram("g", beyond, bins=4)


def test_several_ranks_get_one_directory_each(tmp_path):
    runs = [record(seed=0, steps=4), record(seed=1, steps=4)]
    runs[1] = dataclasses.replace(runs[1], meta={**runs[1].meta, "ranks": [1]})
    merged = ampviz.Run.merge(runs)
    written = to_tensorboard(merged, tmp_path / "tb")
    assert written == [tmp_path / "tb" / "rank0", tmp_path / "tb" / "rank1"]
    for r in (0, 1):
        assert_tensorboard_holds(read_tensorboard(written[r]), merged, rank_index=r)


def test_wandb_offline_file_holds_the_exact_counts(offline_wandb, fp16_run):
    to_wandb(fp16_run, project="ampviz-test")
    rows = wandb_history(offline_wandb)
    assert [row["ampviz/step"] for row in rows] == fp16_run.steps.tolist()
    by_step = {row["ampviz/step"]: row for row in rows}
    for h, step in enumerate(fp16_run.hist_steps.tolist()):
        for t, (name, kind) in enumerate(zip(fp16_run.tensor_names, fp16_run.tensor_kinds)):
            np.testing.assert_array_equal(wandb_row(by_step[step], "ampviz", kind, name), fp16_run.counts[0, h, t])
    assert [row["ampviz/skipped"] for row in rows] == fp16_run.skipped[0].astype(float).tolist()
    assert [row["ampviz/loss_scale"] for row in rows] == fp16_run.loss_scale[0].tolist()


def test_cli_export_to_tensorboard_and_wandb(tmp_path, offline_wandb, fp16_run, capsys):
    path = fp16_run.save(tmp_path / "run.npz")[0]
    assert main(["export", str(path), "--tensorboard", str(tmp_path / "tb"), "--wandb", "--quiet"]) == 0
    assert_tensorboard_holds(read_tensorboard(tmp_path / "tb"), fp16_run)
    assert len(wandb_history(offline_wandb)) == fp16_run.n_steps
    assert "tb" in capsys.readouterr().out


def test_cli_export_errors_are_one_line(tmp_path, fp16_run, capsys):
    path = fp16_run.save(tmp_path / "run.npz")[0]
    assert main(["export", str(path)]) == 2
    assert capsys.readouterr().err.strip() == "ampviz: error: export: give --tensorboard DIR, --wandb, or both"
    assert main(["export", str(tmp_path / "missing.npz"), "--tensorboard", str(tmp_path / "tb")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ampviz: error:") and "missing.npz" in err and err.count("\n") == 1


def test_live_export_writes_each_step_once(tmp_path, fp16_run):
    live = LiveExport(tmp_path / "tb")
    cut = {name: getattr(fp16_run, name)[..., :3] for name in ("steps", "loss", "loss_scale", "next_scale",
                                                               "skipped", "hist_steps", "scheduler_steps")
           if getattr(fp16_run, name) is not None}
    cut.update({name: getattr(fp16_run, name)[:, :3] for name in ("counts", "grad_order")
                if getattr(fp16_run, name) is not None})
    first = dataclasses.replace(fp16_run, **cut)                  # the run as it was three steps in
    assert live.update(first) == 3
    assert live.update(fp16_run) == fp16_run.n_steps - 3
    assert live.update(fp16_run) == 0
    live.close()
    assert_tensorboard_holds(read_tensorboard(tmp_path / "tb"), fp16_run)


def test_bad_arguments_name_themselves(tmp_path, fp16_run):
    with pytest.raises(ValueError, match="domain"):
        to_tensorboard(fp16_run, tmp_path, domain="halved")
    with pytest.raises(TypeError, match="run: expected an ampviz.Run"):
        to_tensorboard("run.npz", tmp_path)
    with pytest.raises(TypeError, match="wandb"):
        LiveExport(wandb="yes")

"""DDP all-reduce byte counts against the parameters' own sizes, in a real one-process gloo group."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook, fp16_compress_hook

from ampviz.lessons.comm import AllReduceLog, counting_hook, ddp_allreduce_bytes, ddp_scaled_steps, one_process_group
from ampviz.lessons.models import MLP


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = MLP(16, 64, 2, 10)
    x, y = torch.randn(32, 16), torch.randint(0, 10, (32,))
    return model, x, y, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16])
def test_default_allreduce_sends_the_fp32_gradients_even_under_autocast(setup, autocast_dtype):
    model, x, y, n = setup
    r = ddp_allreduce_bytes(model, x, y, F.cross_entropy, autocast_dtype=autocast_dtype)
    assert r.grad_dtypes == r.bucket_dtypes == r.sent_dtypes == ["float32"]
    assert r.sent_bytes == r.bucket_bytes == 4 * n
    assert not dist.is_initialized()            # the temporary group is gone


@pytest.mark.parametrize("hook, name", [(fp16_compress_hook, "float16"), (bf16_compress_hook, "bfloat16")])
def test_compression_hooks_halve_the_bytes(setup, hook, name):
    model, x, y, n = setup
    r = ddp_allreduce_bytes(model, x, y, F.cross_entropy, autocast_dtype=torch.bfloat16, hook=hook)
    assert r.grad_dtypes == r.bucket_dtypes == ["float32"] and r.sent_dtypes == [name]
    assert r.bucket_bytes == 4 * n and r.sent_bytes == 2 * n


def test_a_bf16_model_sends_bf16_gradients(setup):
    model, x, y, n = setup
    r = ddp_allreduce_bytes(model.to(torch.bfloat16), x.to(torch.bfloat16), y, F.cross_entropy)
    assert r.grad_dtypes == r.sent_dtypes == ["bfloat16"] and r.sent_bytes == 2 * n


def test_several_buckets_add_up(setup):
    _, x, y, _ = setup
    model = MLP(16, 512, 3, 10)      # 2 MB of gradients: more than DDP's 1 MB first bucket
    n = sum(p.numel() for p in model.parameters())
    r = ddp_allreduce_bytes(model, x, y, F.cross_entropy, bucket_cap_mb=1)
    assert r.n_buckets > 1 and r.sent_bytes == 4 * n


def test_counting_hook_restores_all_reduce_even_when_the_hook_fails():
    real = dist.all_reduce

    class Bucket:
        def buffer(self):
            return torch.zeros(3)

    def broken(state, bucket):
        dist.all_reduce(torch.ones(5, dtype=torch.float16))

    log = AllReduceLog()
    with one_process_group() as created:
        assert created
        counting_hook(broken, log)(None, Bucket())
        assert dist.all_reduce is real

        def raising(state, bucket):
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            counting_hook(raising, log)(None, Bucket())
        assert dist.all_reduce is real
    assert log.bucket_bytes == [12, 12] and log.sent_dtypes == ["float16"] and log.sent_bytes == [10]
    with pytest.raises(TypeError, match="hook"):
        counting_hook("allreduce", log)


def test_an_existing_group_is_reused_and_left_alone():
    with one_process_group() as outer:
        with one_process_group() as inner:
            assert outer and not inner
        assert dist.is_initialized()
    assert not dist.is_initialized()


def test_bad_arguments_are_named(setup):
    model, x, y, _ = setup
    with pytest.raises(TypeError, match="model"):
        ddp_allreduce_bytes(None, x, y, F.cross_entropy)
    with pytest.raises(ValueError, match="autocast_dtype"):
        ddp_allreduce_bytes(model, x, y, F.cross_entropy, autocast_dtype=torch.float32)


def test_fp16_compression_overflows_scaled_gradients_that_fp32_and_bf16_hold(setup):
    model, x, y, _ = setup
    steps = {name: ddp_scaled_steps(model, x, y, F.cross_entropy, hook=hook, init_scale=2.0 ** 24)[0]
             for name, hook in (("default", None), ("fp16", fp16_compress_hook), ("bf16", bf16_compress_hook))}
    assert steps["fp16"]["bucket_amax"] > torch.finfo(torch.float16).max          # the scaled gradients
    assert not steps["default"]["skipped"] and steps["default"]["weights_changed"]
    assert steps["fp16"]["skipped"] and not steps["fp16"]["weights_changed"]      # inf after the cast: skipped
    assert not steps["bf16"]["skipped"] and steps["bf16"]["sent_dtypes"] == ["bfloat16"]
    [small] = ddp_scaled_steps(model, x, y, F.cross_entropy, hook=fp16_compress_hook, init_scale=1.0)
    assert small["bucket_amax"] < 1.0 and not small["skipped"]                    # in range: no skip
    with pytest.raises(ValueError, match="init_scale"):
        ddp_scaled_steps(model, x, y, F.cross_entropy, init_scale=0.0)
    with pytest.raises(ValueError, match="steps"):
        ddp_scaled_steps(model, x, y, F.cross_entropy, steps=0)
    assert not dist.is_initialized()


def test_the_scaler_backs_off_until_the_fp16_bucket_fits(setup):
    """Against the real GradScaler: each overflow in the hook's cast halves the scale, and once the scaled
    gradients fit in fp16 the steps run."""
    model, x, y, _ = setup
    steps = ddp_scaled_steps(model, x, y, F.cross_entropy, hook=fp16_compress_hook, init_scale=2.0 ** 24, steps=8)
    skipped = [s["skipped"] for s in steps]
    n = skipped.index(False)
    assert n >= 1 and not any(skipped[n:])                          # a run of skips, then none
    assert [s["scale"] for s in steps[:n + 1]] == [2.0 ** (24 - i) for i in range(n + 1)]   # halved per skip
    fp16_max = torch.finfo(torch.float16).max
    assert all(s["bucket_amax"] > fp16_max for s in steps[:n]) and steps[n]["bucket_amax"] < fp16_max
    assert all(s["weights_changed"] != s["skipped"] for s in steps)


def test_buckets_default_to_a_small_first_one_unless_a_cap_is_given(setup):
    """torch 2.13: without bucket_cap_mb the first bucket closes at 1 MiB, the others at 25 MiB; an explicit
    bucket_cap_mb applies to the first bucket too."""
    _, x, y, _ = setup
    model = MLP(16, 512, 3, 10)                   # about 2.06 MiB of fp32 gradients
    n = sum(p.numel() for p in model.parameters())
    default = ddp_allreduce_bytes(model, x, y, F.cross_entropy)
    explicit = ddp_allreduce_bytes(model, x, y, F.cross_entropy, bucket_cap_mb=25)
    assert default.bucket_cap_bytes == explicit.bucket_cap_bytes == 25 * 2 ** 20
    assert default.n_buckets == 2 and default.bucket_sizes[0] >= dist._DEFAULT_FIRST_BUCKET_BYTES
    assert explicit.n_buckets == 1 and sum(default.bucket_sizes) == explicit.bucket_sizes[0] == 4 * n


def test_the_first_backward_uses_one_bucket_until_ddp_rebuilds_them(setup):
    """torch 2.13, find_unused_parameters=False: the first backward all-reduces every gradient in one bucket
    (initial limit sys.maxsize); DDP rebuilds the buckets by size before the second forward (lesson 02b)."""
    _, x, y, _ = setup
    r = ddp_allreduce_bytes(MLP(16, 512, 3, 10), x, y, F.cross_entropy)
    assert r.first_pass_buckets == 1 and r.n_buckets == 2


def test_the_gradients_after_a_compression_hook_are_the_rounded_averages(setup):
    """One rank: the average is the gradient itself, so a compression hook's only effect is its cast."""
    model, x, y, _ = setup
    runs = {name: ddp_allreduce_bytes(model, x, y, F.cross_entropy, hook=hook)
            for name, hook in (("plain", None), ("fp16", fp16_compress_hook), ("bf16", bf16_compress_hook))}
    for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        for g, exact in zip(runs[name].grads, runs["plain"].grads):
            assert g.dtype == torch.float32 and torch.equal(g, exact.to(dt).float())
    assert any(not torch.equal(a, b) for a, b in zip(runs["bf16"].grads, runs["plain"].grads))

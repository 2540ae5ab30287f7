"""ampviz.lessons.ddp_training on two real gloo ranks: what DDP all-reduces under autocast, and resuming."""

import pytest

from ampviz.examples.ddp_amp import Config
from ampviz.examples.distributed import Workers
from ampviz.lessons import ddp_training

pytestmark = pytest.mark.slow


def test_autocast_does_not_change_what_ddp_all_reduces_and_resuming_needs_every_rank(tmp_path):
    config = Config(steps=16, accum=2, batch=16, lr=1e-2, growth_interval=3, warmup=4, progress=False)
    with Workers(2, timeout=300) as workers:
        sent = workers.run(ddp_training.all_reduce_dtypes)
        resumed = workers.run(ddp_training.resume_variants, config, 8, str(tmp_path))
    for r in sent:
        assert r["fp16 autocast"]["logits"] == "torch.float16" and r["bf16 autocast"]["logits"] == "torch.bfloat16"
        for label in ("fp16 autocast", "bf16 autocast"):
            assert r[label]["bucket"] == r[label]["gradients"] == "torch.float32"
            assert r[label]["bytes sent"] == r["fp32"]["bytes sent"]
    straight = [r["uninterrupted"] for r in resumed]
    every = [r["every rank"] for r in resumed]
    assert straight[0] == straight[1] and every == straight          # bit-identical weights, same scale and LR
    assert resumed[0]["saved step"] == 8 and resumed[0]["saved scale"] != config.init_scale
    one = [r["scaler on rank 0 only"] for r in resumed]
    assert one[0]["checksum"] != one[1]["checksum"]                  # the replicas drifted apart, silently
    none = [r["scaler on no rank"] for r in resumed]
    assert none[0] == none[1]                                        # a fresh scaler everywhere: still replicas

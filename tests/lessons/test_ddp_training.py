"""ampviz.lessons.ddp_training on two real gloo ranks: resuming on every rank, or the scaler on one."""

import pytest

from ampviz.examples.ddp_amp import Config
from ampviz.lessons import ddp_training
from ampviz.lessons.launch import Workers

pytestmark = pytest.mark.slow


def test_a_run_resumed_on_every_rank_is_the_uninterrupted_run_and_a_scaler_on_one_rank_drifts(tmp_path):
    config = Config(steps=16, accum=2, batch=16, lr=1e-2, growth_interval=3, warmup=4, progress=False)
    with Workers(2, timeout=300) as workers:
        resumed = workers.run(ddp_training.resume_variants, config, 8, str(tmp_path))
    straight = [r["uninterrupted"] for r in resumed]
    every = [r["every rank"] for r in resumed]
    assert straight[0] == straight[1] and every == straight          # bit-identical weights, same scale and LR
    assert resumed[0]["saved step"] == 8 and resumed[0]["saved scale"] != config.init_scale
    one = [r["scaler on rank 0 only"] for r in resumed]
    assert one[0]["checksum"] != one[1]["checksum"]                  # the replicas drifted apart, silently
    none = [r["scaler on no rank"] for r in resumed]
    assert none[0] == none[1]                                        # a fresh scaler everywhere: still replicas

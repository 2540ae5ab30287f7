"""ampviz.lessons.ddp_inside on two real gloo ranks: the article's launcher, DDP's buckets and lone forwards."""

import json
import os

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from ampviz.lessons import ddp_inside, ddp_ranks
from ampviz.lessons.launch import Workers, free_port

pytestmark = pytest.mark.slow


def test_mp_spawn_with_tcp_joins_without_torchruns_environment_and_gets_the_default_timeout(tmp_path):
    mp.spawn(ddp_inside.spawned_rank, args=(2, free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world_size"] == 2 for r in ranks)
    assert all(r["all_reduce"] == 3.0 for r in ranks)
    assert all(v is None for r in ranks for v in r["environment"].values())      # no RANK, MASTER_ADDR...
    expected = dist.constants.default_pg_timeout.total_seconds()
    assert all(r["timeout_seconds"] == expected for r in ranks)
    assert sorted(os.listdir(tmp_path)) == ["rank0.json", "rank1.json"]            # no temporary file left


def test_buckets_are_rebuilt_after_the_first_backward_and_which_forwards_are_collectives():
    with Workers(2, timeout=180) as workers:
        events = workers.run(ddp_inside.bucket_events, 3, 4, 256, 0.5)
        lone = workers.run(ddp_inside.lone_forward, 2.0)
        sent = workers.run(ddp_ranks.forward_broadcasts)
    # buffers: rank 0's win in a forward; whether the next forward syncs them depends on the last one's grad mode
    assert sent[0]["buffer after forward"] == sent[1]["buffer after forward"] == [0.0, 0.0]
    assert all(r["forward syncs buffers"] and not r["syncs after a no_grad forward"] for r in sent)
    for r in events:
        first, later = r["events"][0], r["events"][1:]
        # iteration 0: one bucket, all-reduced after the last gradient
        assert first == ["grad 3", "grad 2", "grad 1", "grad 0", "all-reduce bucket 0 (4 layers)"]
        for it in later:                  # rebuilt: the first bucket leaves before layer 0's gradient exists
            assert sum(e.startswith("all-reduce") for e in it) == 2
            assert it.index("all-reduce bucket 0 (2 layers)") < it.index("grad 0")
        assert sum(r["rebuilt_buckets"]) == sum(r["first_buckets"]) == 4 * r["layer_bytes"]
        assert isinstance(r["default_cap_bytes"], int) and isinstance(r["default_first_bucket_bytes"], int)
    # a model without buffers: a lone forward under no_grad sends nothing; with grad, it waits for the other rank
    rank0 = lone[0]
    assert rank0["buffers"] == 0 and not rank0["syncs_buffers"]
    assert rank0["no_grad_seconds"] < 1.0
    assert rank0["error"] is not None and "Timed out" in rank0["error"]
    assert 1.5 < rank0["grad_seconds"] < 10

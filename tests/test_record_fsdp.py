"""FSDP2 (issue 10 item 9): gradients are sharded DTensors; each rank counts its local shard, so the ranks'
weight counts add up to the histogram of the full gradient. 2 CPU ranks on gloo, against the unsharded model
trained on the same data in the same processes (FSDP2 runs on the CPU with gloo in torch 2.13)."""

import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import ampviz


@pytest.mark.slow
def test_fsdp2_local_shard_counts_add_up_to_the_full_gradient(tmp_path):
    import _fsdp_worker
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_fsdp_worker.run, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    run = ampviz.Run.load(tmp_path)
    assert run.ranks == [0, 1] and run.meta["world_size"] == 2
    weights = [i for i, k in enumerate(run.tensor_kinds) if k == "weight"]
    acts = [i for i, k in enumerate(run.tensor_kinds) if k == "activation"]
    n = len(weights)
    assert run.tensor_names[:n] == [name for name, _ in _fsdp_worker.model().named_parameters()]
    unsharded = np.load(tmp_path / "unsharded0.npy")                   # (steps, 2 n, NBINS)
    np.testing.assert_array_equal(unsharded, np.load(tmp_path / "unsharded1.npy"))
    direct, gathered = unsharded[:, :n], unsharded[:, n:]
    np.testing.assert_array_equal(direct, gathered)                    # same data: the same gradient bit for bit
    # each rank holds a shard (rows split 4 + 3 for a 7-row weight); their counts add up to the full gradient's
    shard_sizes = torch.load(tmp_path / "weights0.pt", weights_only=True)["local_sizes"]
    assert run.counts[0, :, weights].sum(axis=-1).tolist() != run.counts[1, :, weights].sum(axis=-1).tolist()
    assert run.counts[0, 0, weights].sum(axis=-1).tolist() == shard_sizes
    np.testing.assert_array_equal(run.counts[:, :, weights].sum(axis=0), direct)
    # activation gradients are not sharded: every rank saw the whole batch
    for r in (0, 1):
        assert (run.counts[r, :, acts].sum(axis=-1) > 0).all()
    np.testing.assert_array_equal(run.counts[0, :, acts], run.counts[1, :, acts])
    for r in (0, 1):
        w = torch.load(tmp_path / f"weights{r}.pt", weights_only=True)
        assert all(torch.equal(a, b) for a, b in zip(w["sharded"], w["unsharded"]))

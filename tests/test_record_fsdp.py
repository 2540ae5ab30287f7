"""FSDP2 (issue 10 item 9): gradients are sharded DTensors; each rank counts its local shard, so the ranks'
weight counts add up to the histogram of the full gradient. 2 CPU ranks on gloo, against the unsharded model
trained on the same data in the same processes (FSDP2 runs on the CPU with gloo in torch 2.13)."""

import socket
import warnings

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import ampviz


def spawn_fsdp(out_dir) -> None:
    import _fsdp_worker
    out_dir.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_fsdp_worker.run, args=(2, port, str(out_dir)), nprocs=2, join=True)


@pytest.mark.slow
def test_fsdp2_local_shard_counts_add_up_to_the_full_gradient(tmp_path, capfd):
    import _fsdp_worker
    try:
        spawn_fsdp(tmp_path := tmp_path / "run")
    except mp.ProcessExitedException as e:
        # a rank killed by a signal (not a Python error): 2 of 6 full suites (never this test alone: 0 of 61 runs)
        # lost rank 1 to SIGABRT / SIGSEGV, cause not yet known. Run once more; the warning carries the crashed
        # rank's stacks (faulthandler), so the CI log shows where it died; a second crash fails the test
        if not e.signal_name:
            raise
        warnings.warn(f"FSDP2 on gloo: rank {e.error_index} died with {e.signal_name}; ran it again. "
                      f"stderr:\n{capfd.readouterr().err[-6000:]}", stacklevel=1)
        spawn_fsdp(tmp_path := tmp_path.with_name("again"))
    run = ampviz.Run.load(tmp_path)
    assert run.ranks == [0, 1] and run.meta["world_size"] == 2
    weights, acts = run.tensors_of("weight"), run.tensors_of("activation")
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

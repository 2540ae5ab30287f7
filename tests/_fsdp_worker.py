"""FSDP2 (fully_shard) on 2 CPU ranks over gloo, recorded; and the same model unsharded on the same data
(run by tests/test_record_fsdp.py through torch.multiprocessing.spawn)."""

import faulthandler
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _ddp_worker import exit_worker

import ampviz
from ampviz import histogram as H


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 7), nn.LayerNorm(7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))


def run(rank, world, port, out_dir, steps=3):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    faulthandler.enable(all_threads=True)      # a crash prints every thread's stack (pytest shows stderr)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        sharded, full = model(), model()
        mesh = init_device_mesh("cpu", (world,))
        for layer in sharded:
            if isinstance(layer, (nn.Linear, nn.LayerNorm)):
                fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        opt, full_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (sharded, full))
        g = torch.Generator().manual_seed(7)                     # the same data on every rank
        full_counts = []
        with ampviz.Recorder(sharded, opt, path=out_dir) as rec:
            for _ in range(steps):
                x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
                F.cross_entropy(sharded(x), y).backward()
                full_grads = [p.grad.full_tensor() for p in sharded.parameters()]     # all-gathered
                F.cross_entropy(full(x), y).backward()
                full_counts.append([H.histogram(p.grad).numpy() for p in full.parameters()])
                full_counts[-1] += [H.histogram(t).numpy() for t in full_grads]
                opt.step()
                full_opt.step()
                opt.zero_grad(set_to_none=True)
                full_opt.zero_grad(set_to_none=True)
                rec.step()
        np.save(os.path.join(out_dir, f"unsharded{rank}.npy"), np.array(full_counts))
        shards = [p.detach().full_tensor() for p in sharded.parameters()]
        torch.save({"sharded": shards, "unsharded": [p.detach() for p in full.parameters()],
                    "local_sizes": [p.to_local().numel() for p in sharded.parameters()]},
                   os.path.join(out_dir, f"weights{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_worker()

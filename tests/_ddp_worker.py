"""A 2-process gloo DDP + fp16 GradScaler + accumulation loop recorded on every rank (run by test_record)."""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ampviz


def run(rank, world, port, out_dir, accum=2, steps=4):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
        g = torch.Generator().manual_seed(100 + rank)          # each rank sees different data
        rec = ampviz.Recorder(ddp, opt, scaler=scaler, local_weights=True, path=out_dir)
        with rec:
            for _ in range(steps):
                for micro in range(accum):
                    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
                    sync = micro == accum - 1
                    ctx = ddp.no_sync() if not sync else _null()
                    with ctx:
                        with torch.autocast("cpu", dtype=torch.float16):
                            loss = F.cross_entropy(ddp(x), y) / accum
                        scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                rec.step(loss)
        torch.save([p.detach() for p in model.parameters()], os.path.join(out_dir, f"params{rank}.pt"))
    finally:
        dist.destroy_process_group()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

"""A 2-process gloo DDP + fp16 GradScaler + accumulation loop recorded on every rank (run by test_record)."""

import faulthandler
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ampviz


def exit_worker() -> None:
    """End a worker whose work is saved (after a barrier, so no rank closes its sockets while the other still
    uses them): exit without the interpreter's teardown, where a process group still held by torch's caches
    (the device mesh) is destroyed while its gloo threads run. That crashed one FSDP2 rank with SIGABRT
    ("terminate called without an active exception") in one full-suite run under load."""
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(rank, world, port, out_dir, accum=2, steps=4, file_name=None):
    faulthandler.enable(all_threads=True)      # a crash prints every thread's stack (pytest shows stderr)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
        g = torch.Generator().manual_seed(100 + rank)          # each rank sees different data
        path = out_dir if file_name is None else os.path.join(out_dir, file_name)
        rec = ampviz.Recorder(ddp, opt, scaler=scaler, local_weights=True, path=path)
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
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_worker()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ----------------------------------------------------------------------------- under torchrun: BERT + no_sync
def bert_run(out_dir, steps=3, accum=2):
    """Train a small random-init BERT with DDP, accumulation and no_sync, without and then with a Recorder
    (and without again); write each rank's final weights and torch's thread counts."""
    import json

    from transformers import BertConfig, BertForSequenceClassification
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    threads = {"start": torch.get_num_threads()}
    try:
        finals = []
        for record in (False, True, False):
            torch.manual_seed(0)                              # the same weights and dropout masks each time
            config = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=256, max_position_embeddings=64, num_labels=3)
            ddp = nn.parallel.DistributedDataParallel(BertForSequenceClassification(config))
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
            g = torch.Generator().manual_seed(10 + rank)
            rec = ampviz.Recorder(ddp, opt, enabled=record)
            with rec:
                for _ in range(steps):
                    for micro in range(accum):
                        ids, y = torch.randint(0, 128, (8, 32), generator=g), torch.randint(0, 3, (8,), generator=g)
                        with ddp.no_sync() if micro < accum - 1 else _null():
                            loss = ddp(input_ids=ids, labels=y).loss / accum
                            loss.backward()
                            if record:
                                threads.setdefault("inside", set()).add(torch.get_num_threads())
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    rec.step(loss)
            if record:
                threads["rows_filled"] = int((rec.run.counts[0].sum(axis=-1) > 0).all(axis=0).sum())
                threads["rows"] = len(rec.run.tensor_names)
            finals.append([p.detach().clone() for p in ddp.module.parameters()])
        threads["after"] = torch.get_num_threads()
        threads["inside"] = sorted(threads.get("inside", []))
        torch.save(finals, os.path.join(out_dir, f"bert{rank}.pt"))
        with open(os.path.join(out_dir, f"threads{rank}.json"), "w") as f:
            json.dump(threads, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_worker()


if __name__ == "__main__":
    import sys
    bert_run(sys.argv[1])

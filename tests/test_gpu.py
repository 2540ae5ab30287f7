"""GPU checks (skipped without CUDA): the capture path makes no host sync, and counts match CPU."""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampviz
from ampviz import histogram as H

pytestmark = pytest.mark.gpu


def test_histogram_on_cuda_equals_cpu():
    x = torch.randn(100_000, dtype=torch.float32) * torch.exp2(torch.randint(-40, 20, (100_000,)).float())
    x[:10] = 0
    x[10] = float("inf")
    x[11] = float("nan")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cpu = H.histogram(x.to(dtype))
        gpu = H.histogram(x.to(dtype).cuda())
        assert gpu.device.type == "cuda"
        assert torch.equal(cpu, gpu.cpu())


class _sync_is_an_error:
    def __enter__(self):
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(0)
        return False


def test_recorded_steps_make_no_host_sync():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    scaler = torch.amp.GradScaler("cuda")
    x, y = torch.randn(64, 256, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
    rec = ampviz.Recorder(model, opt, scaler=scaler, flush_every=8)
    with rec:
        for _ in range(7):                          # fewer steps than flush_every: no flush inside
            with torch.amp.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            with _sync_is_an_error():
                scaler.scale(loss).backward()       # activation-gradient hooks fire here
            scaler.step(opt)                        # GradScaler itself reads found_inf (a sync): not ours
            scaler.update()
            with _sync_is_an_error():
                opt.zero_grad(set_to_none=True)
                rec.step(loss)                      # loss, scale, counts: device-side copies only
    run = rec.run
    assert run.n_steps == 7 and np.isfinite(run.loss).all()
    assert run.counts[0, :, 0].sum(axis=-1).tolist() == [256 * 512] * 7


def test_weight_hook_makes_no_host_sync():
    """The optimizer pre-hook (weight-gradient keys + count) runs with sync debug mode on."""
    model = nn.Linear(1024, 1024).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = ampviz.Recorder(model, opt, activations=False)
    with rec:
        model(torch.randn(8, 1024, device="cuda")).sum().backward()
        with _sync_is_an_error():
            rec._on_optimizer_step(opt, (), {})
            rec._binning.submit()
        opt.step()
        rec.step()
    assert rec.run.counts[0, 0, 0].sum() == 1024 * 1024

"""GPU checks: the counting kernels equal the CPU bins, and recorded steps make no host sync.

Skipped without CUDA. ``benchmarks/gpu_check.sh --device cpu`` runs the same tests on the CPU
(``AMPVIZ_TEST_DEVICE=cpu``, the Triton kernel in Triton's interpreter with ``TRITON_INTERPRET=1`` and
``AMPVIZ_COUNTER=triton``), where "no host sync" holds trivially and the counts are still checked.
"""

import contextlib
import os

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import frexp_columns

import ampviz
from ampviz import histogram as H
from ampviz._counting import NBINS, Binner, make_counter

pytestmark = pytest.mark.gpu

DEVICE = torch.device(os.environ.get("AMPVIZ_TEST_DEVICE", "cuda"))
ON_CUDA = DEVICE.type == "cuda"
triton_counter = pytest.importorskip("ampviz._counting.gpu_kernel")
needs_triton = pytest.mark.skipif(not triton_counter.available() or (not ON_CUDA and not triton_counter.interpreted()),
                                  reason="needs triton (on the CPU: its interpreter, TRITON_INTERPRET=1)")
FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


@contextlib.contextmanager
def no_host_sync():
    """Any device->host sync inside is an error (CUDA's sync debug mode); nothing to check on the CPU."""
    if not ON_CUDA:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def wide_values(n: int, seed: int = 0) -> torch.Tensor:
    """fp32 values over every binade, with zeros, signed zeros, infinities, nan and the edges of the ranges."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-150, 129, (n,), generator=g).float())
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 2.0 ** -126, 2.0 ** -149,
                            2.0 ** -24, 2.0 ** -25, 65504.0, 65520.0, 448.0, 464.0, 2.0 ** 127])
    k = min(n, special.numel())
    x[:k] = special[:k]
    return x


def oracle(x: torch.Tensor) -> np.ndarray:
    values = (x.float() if x.dtype != torch.float64 else x).cpu().numpy().reshape(-1)
    return np.bincount(frexp_columns(values), minlength=NBINS)


def assert_counts_every_dtype(counter, x):
    """``x`` cast to each of FLOATS, one row each, counted with no host sync: each row equals the oracle."""
    target = torch.zeros(len(FLOATS) * NBINS, dtype=torch.int64, device=DEVICE)
    counter.target = target
    with no_host_sync():
        for row, dtype in enumerate(FLOATS):
            counter.add(x.to(dtype).to(DEVICE), row)
        counter.submit()
    got = target.view(len(FLOATS), NBINS).cpu().numpy()
    for row, dtype in enumerate(FLOATS):
        np.testing.assert_array_equal(got[row], oracle(x.to(dtype)), err_msg=str(dtype))


def test_histogram_equals_the_oracle_for_every_dtype():
    x = wide_values(100_000)
    for dtype in FLOATS + [torch.float64]:
        counts = H.histogram(x.to(dtype).to(DEVICE))
        assert counts.device.type == DEVICE.type
        np.testing.assert_array_equal(counts.cpu().numpy().reshape(-1), oracle(x.to(dtype)), err_msg=str(dtype))


@needs_triton
@pytest.mark.parametrize("n", [0, 1, 4095, 4097, 5 * 4096 + 7])
def test_triton_kernel_equals_the_oracle(n):
    # programs=2: five blocks and a tail walk the grid-stride loop; masked lanes never counted
    x = wide_values(max(n, 1), seed=n)[:n]
    assert_counts_every_dtype(triton_counter.TritonCounter(DEVICE, programs=2), x)


@needs_triton
def test_triton_counter_takes_what_the_binner_takes():
    # a transposed gradient (a view), complex values (|z|), fp64 (torch path), rows accumulated twice
    x = wide_values(3 * 4096 + 5, seed=1)
    m = x[:64 * 192].view(64, 192).t()
    z = torch.complex(x[:1000], x[1000:2000])
    counter = triton_counter.TritonCounter(DEVICE, programs=3)
    target = torch.zeros(4 * NBINS, dtype=torch.int64, device=DEVICE)
    counter.target = target
    with no_host_sync():
        counter.add(m.to(DEVICE), 0)
        counter.add(z.to(DEVICE), 1)
        counter.add(x.double().to(DEVICE), 2)
        counter.add_many([x.to(DEVICE), x.to(DEVICE)], [3, 3])
        counter.submit()
    got = target.view(4, NBINS).cpu().numpy()
    np.testing.assert_array_equal(got[0], oracle(m))
    np.testing.assert_array_equal(got[1], oracle(z.abs()))
    np.testing.assert_array_equal(got[2], oracle(x.double()))
    np.testing.assert_array_equal(got[3], 2 * oracle(x))


def test_torch_path_equals_the_oracle():
    x = wide_values(50_000, seed=2)
    assert_counts_every_dtype(Binner(DEVICE), x)


def _train(record: bool, steps: int, amp: str, **options):
    """A small MLP trained ``steps`` steps under autocast (fp16 with a GradScaler, or bf16); the recorded run
    or None, and the final weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))
    model = model.to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    scaler = torch.amp.GradScaler(DEVICE.type, enabled=amp == "fp16")
    dtype = torch.float16 if amp == "fp16" else torch.bfloat16
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 256, generator=g).to(DEVICE), torch.randint(0, 10, (64,), generator=g).to(DEVICE)
    rec = ampviz.Recorder(model, opt, scaler=scaler, scheduler=sched, flush_every=steps + 1, enabled=record,
                          **options)
    with rec:
        for _ in range(steps):                      # fewer steps than flush_every: no flush inside
            with no_host_sync():
                with torch.amp.autocast(DEVICE.type, dtype=dtype):
                    loss = F.cross_entropy(model(x), y)   # forward outputs counted here
                scaler.scale(loss).backward()       # activation-gradient hooks fire here
            scaler.step(opt)                        # GradScaler reads found_inf (a sync of its own, not ours)
            scaler.update()
            with no_host_sync():
                sched.step()
                opt.zero_grad(set_to_none=True)
                rec.step(loss)                      # loss, scale, scheduler epoch, counts: device-side only
    return (rec.run if record else None), [p.detach().cpu().clone() for p in model.parameters()]


@pytest.mark.parametrize("amp", ["fp16", "bf16"])
@pytest.mark.parametrize("counter", ["default", "torch"])
def test_recorded_steps_make_no_host_sync_and_change_nothing(amp, counter, monkeypatch):
    if counter == "torch":
        monkeypatch.setenv("AMPVIZ_COUNTER", "torch")
    run, weights = _train(True, 5, amp, outputs=True)
    _, plain = _train(False, 5, amp)
    assert all(torch.equal(a, b) for a, b in zip(weights, plain)), "recording changed training"
    assert run.n_steps == 5 and np.isfinite(run.loss).all()
    assert run.counts[0, :, 0].sum(axis=-1).tolist() == [256 * 512] * 5        # first weight, every step
    outputs = run.tensor_indices(kind="output")
    assert run.counts[0, :, outputs[0]].sum(axis=-1).tolist() == [64 * 512] * 5
    assert run.scheduler_steps[0].tolist() == [1, 2, 3, 4, 5] and (run.grad_order[0, :, 0] >= 0).all()


def test_the_default_counter_on_this_device_equals_the_oracle():
    # what a Recorder on this device counts with (Triton on a GPU; AMPVIZ_COUNTER picks another)
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(300, 200, generator=g) * 2.0 ** -20, torch.randn(4097, generator=g).bfloat16(),
             torch.randn(64, 64, generator=g).half() * 2.0 ** -14]
    target = torch.zeros(len(grads) * NBINS, dtype=torch.int64, device=DEVICE)
    counter = make_counter(DEVICE)
    counter.target = target
    with no_host_sync():
        counter.add_many([t.to(DEVICE) for t in grads], list(range(len(grads))))
        counter.submit()
    counter.close()
    got = target.view(len(grads), NBINS).cpu().numpy()
    for row, t in enumerate(grads):
        np.testing.assert_array_equal(got[row], oracle(t))

"""ampviz.integrations.accelerate.Recorder in a real accelerate loop (prepare, accumulate, backward, step),
against gradients captured before each real optimizer step, binned with numpy.frexp, and against
accelerate's own skipped flag."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _oracles import binned, params_equal

import ampviz

accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402

from ampviz.integrations.accelerate import Recorder  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    # accelerate keeps one process-wide state; a new mixed_precision needs it reset (transformers'
    # TrainingArguments does the same)
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def loop(mixed_precision="bf16", record=True, accumulate=2, micro_batches=12, scaler=None, oracle=None):
    """Train a small MLP the way accelerate's docs write it. ``scaler``: accelerate's fp16 path as it runs
    on a GPU (autocast and this GradScaler), which accelerate 1.15 never enables on a CPU by itself."""
    accelerator = Accelerator(mixed_precision=mixed_precision, gradient_accumulation_steps=accumulate, cpu=True)
    if scaler is not None:
        accelerator.native_amp, accelerator.scaler = True, scaler
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(micro_batches * 4, 16, generator=g),
                                          torch.randint(0, 5, (micro_batches * 4,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    rec = Recorder(accelerator, model, optimizer, enabled=record)
    losses, window = [], []
    with rec:
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x).float(), y)
                accelerator.backward(loss)
                if oracle is not None and accelerator.sync_gradients:
                    oracle.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
                optimizer.step()
                optimizer.zero_grad()
            rec.step(loss)
            window.append(loss.detach())
            if accelerator.sync_gradients:
                losses.append((torch.stack(window).mean().item(), optimizer.step_was_skipped))
                window = []
    return model, (rec.run if record else None), losses


def test_records_an_accumulated_accelerate_loop_against_an_oracle():
    grads = []
    _, run, losses = loop("bf16", oracle=grads)
    assert run.n_steps == len(grads) == 6                       # 12 micro-batches, 2 per optimizer step
    np.testing.assert_allclose(run.loss[0], [loss for loss, _ in losses], rtol=1e-6)
    for step, step_grads in enumerate(grads):
        for name, grad in step_grads.items():
            np.testing.assert_array_equal(run.histogram(step, name), binned(grad), err_msg=f"{name} step {step}")
    assert run.tensor_dtypes[run.tensor_index("0")] == "torch.bfloat16"
    assert (run.counts.sum(axis=-1)[0, :, run.tensor_index("0")] == 2 * 4 * 32).all()   # both micro-batches


def test_fp16_with_accelerates_grad_scaler_matches_its_skipped_flag():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 22, growth_interval=2)
    _, run, losses = loop("fp16", scaler=scaler, micro_batches=16)
    accelerate_skipped = [skipped for _, skipped in losses]     # SGD is not fused: accelerate's flag is right here
    assert any(accelerate_skipped) and not all(accelerate_skipped)
    np.testing.assert_array_equal(run.skipped[0], accelerate_skipped)
    assert run.tensor_dtypes[run.tensor_index("0")] == "torch.float16"
    assert run.next_scale[0, -1] == scaler.get_scale()


@pytest.mark.parametrize("mixed_precision", ["bf16", "fp16-scaler"])
def test_training_is_bit_identical_with_and_without_the_recorder(mixed_precision):
    def once(record):
        if mixed_precision == "bf16":
            return loop("bf16", record=record)[0]
        AcceleratorState._reset_state(reset_partial_state=True)
        return loop("fp16", record=record, scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 22))[0]
    plain = once(False)
    AcceleratorState._reset_state(reset_partial_state=True)
    assert params_equal(plain, once(True))


def test_fp16_on_a_cpu_trains_in_fp32_and_the_recorder_says_so():
    with pytest.warns(ampviz.AmpvizWarning, match="fp32"):
        _, run, _ = loop("fp16")
    assert (run.loss_scale == 1).all() and run.tensor_dtypes[run.tensor_index("0")] == "torch.float32"


def test_bad_arguments():
    with pytest.raises(TypeError, match="accelerator"):
        Recorder("accelerator", torch.nn.Linear(2, 2))
    accelerator = Accelerator(cpu=True)
    with pytest.raises(TypeError, match="scaler"):
        Recorder(accelerator, torch.nn.Linear(2, 2), scaler=None)

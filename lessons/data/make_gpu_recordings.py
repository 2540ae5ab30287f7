"""Record a GPT-2-small-sized model on a real GPU, in fp16 with a GradScaler and in bf16, for learners without one.

    python lessons/data/make_gpu_recordings.py                  # on a CUDA machine: both runs into lessons/data/
    python lessons/data/make_gpu_recordings.py --device cpu --size tiny --steps 40 --out /tmp/rec   # a dry run

The model is transformers' ``GPT2LMHeadModel`` built from a config (12 layers, width 768, 12 heads, vocabulary
50,257: GPT-2 small's shape) with random weights; the data is generated on the device: a synthetic language in
which each token has eight possible successors with Zipf-like probabilities, so the loss falls from ln 50257
towards that language's entropy. Nothing is downloaded. Each run trains with AdamW (fp32 master weights, a
linear warm-up) and is recorded by ``ampviz.Recorder`` (weight and activation gradients, forward outputs, the
loss scale) every ``steps / 60`` steps, then thinned until the file is at most ``--max-mb``. Device, torch, CUDA
and Triton versions go into the run's metadata (``run.meta["recorded_on"]``). A run stops early at ``--seconds``
(the GPU check's time budget), and says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

import ampviz

SIZES = {"small": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257},
         "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 512, "bos_token_id": 0, "eos_token_id": 0}}


def synthetic_language(vocab: int, seq: int, device, sequences: int = 4096, seed: int = 0):
    """A sampler of (batch, seq + 1) token sequences drawn from a corpus of ``sequences`` generated ones, in which
    each token has 8 successors with weights 1/k^1.2 (the corpus is made once: a Markov chain needs a loop)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 8), generator=g).to(device)
    weights = (1.0 / torch.arange(1, 9, dtype=torch.float32) ** 1.2).to(device)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    corpus = torch.empty(sequences, seq + 1, dtype=torch.long, device=device)
    corpus[:, 0] = torch.randint(0, vocab, (sequences,), device=device, generator=gen)
    picks = torch.multinomial(weights.expand(sequences * seq, 8), 1, replacement=True, generator=gen)
    picks = picks.view(sequences, seq)
    for t in range(seq):
        corpus[:, t + 1] = successors[corpus[:, t], picks[:, t]]

    def batch(n: int) -> torch.Tensor:
        return corpus[torch.randint(0, sequences, (n,), device=device, generator=gen)]
    return batch


def recorded_on(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "device": str(device), "cuda": torch.version.cuda}
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def train(amp: str, a, device: torch.device) -> ampviz.Run:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_positions=a.seq, **SIZES[a.size])
    model = GPT2LMHeadModel(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, a.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")
    dtype = torch.float16 if amp == "fp16" else torch.bfloat16
    batch = synthetic_language(config.vocab_size, a.seq, device)
    every = max(1, a.steps // 60)
    rec = ampviz.Recorder(model, opt, scaler=scaler, scheduler=sched, activations=True, outputs=True,
                          every=every, max_bytes=int(a.max_mb * 24 * 2 ** 20))   # ~24x compression on disk
    t0, done = time.perf_counter(), 0
    with rec:
        for step in range(a.steps):
            tokens = batch(a.batch)
            with torch.amp.autocast(device.type, dtype=dtype):
                logits = model(tokens[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scale_before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if scaler.get_scale() >= scale_before:         # warm-up counts applied steps, not skipped ones
                sched.step()
            opt.zero_grad(set_to_none=True)
            rec.step(loss)
            done = step + 1
            if time.perf_counter() - t0 > a.seconds:
                break
    run = rec.run
    run.meta["recorded_on"] = recorded_on(device)
    run.meta["model"] = {"name": "GPT2LMHeadModel, random weights", **SIZES[a.size], "n_positions": a.seq,
                         "parameters": sum(p.numel() for p in model.parameters())}
    run.meta["training"] = {"amp": amp, "steps_planned": a.steps, "steps_done": done, "batch": a.batch,
                            "seq": a.seq, "lr": a.lr, "seconds": round(time.perf_counter() - t0, 1),
                            "data": "synthetic: 8 successors per token, weights 1/k^1.2"}
    if done < a.steps:
        print(f"  {amp}: stopped at step {done} of {a.steps} (--seconds {a.seconds})")
    return run


def thinned(run: ampviz.Run, path: Path, max_mb: float) -> int:
    """Save ``run`` to ``path``, dropping every other recorded step until the file is at most ``max_mb``; the
    number of halvings."""
    halvings = 0
    while True:
        run.save(path)
        if path.stat().st_size <= max_mb * 2 ** 20 or run.hist_steps.size <= 2:
            return halvings
        keep = slice(None, None, 2)
        run = dataclasses.replace(run, hist_steps=run.hist_steps[keep], counts=run.counts[:, keep],
                                  grad_order=None if run.grad_order is None else run.grad_order[:, keep],
                                  meta=dict(run.meta, every=2 * int(run.meta.get("every", 1)),
                                            thinned=int(run.meta.get("thinned", 0)) + 1))
        halvings += 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run)")
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--seconds", type=float, default=100.0, help="stop each run after this long")
    ap.add_argument("--max-mb", type=float, default=4.0, help="largest file to ship, per run")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    ap.add_argument("--amp", default="fp16,bf16", help="which runs: fp16 (with a GradScaler), bf16, or both")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (a dry run: --device cpu --size tiny)")
    if a.steps < 1 or a.batch < 1 or a.seq < 2:
        ap.error(f"--steps, --batch must be >= 1 and --seq >= 2, got {a.steps}, {a.batch}, {a.seq}")
    a.out.mkdir(parents=True, exist_ok=True)
    for amp in [x for x in a.amp.split(",") if x]:
        if amp not in ("fp16", "bf16"):
            ap.error(f"--amp: expected fp16 and/or bf16, got {amp!r}")
        run = train(amp, a, device)
        path = a.out / f"gpt2_{a.size}_{amp}.npz"
        halvings = thinned(run, path, a.max_mb)
        t = run.meta["training"]
        print(f"{path}: {path.stat().st_size / 2 ** 20:.2f} MB, {t['steps_done']} steps in {t['seconds']} s, "
              f"loss {run.loss[0][0]:.2f} -> {run.loss[0][-1]:.2f}, {int(run.skipped.sum())} skipped, "
              f"thinned {halvings}x, {run.meta['recorded_on']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

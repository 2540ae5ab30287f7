#!/usr/bin/env bash
# The GPU checks, as one script for a machine with a CUDA device (about 5 minutes on one GPU).
# The environment must already hold ampviz's dependencies with a CUDA build of torch.
#   1. tests marked `gpu`: bins on the GPU equal the CPU's; recorded steps (activation hooks,
#      optimizer pre-hook, rec.step) run under torch.cuda.set_sync_debug_mode("error");
#   2. the capture benchmark with fp16 autocast + torch.amp.GradScaler("cuda") on a larger MLP (every variant,
#      outputs=True ones included).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
python -m pytest -p no:nbmake -o addopts="" -m gpu tests -q -rs    # incl. outputs=/scheduler= without a sync
python benchmarks/capture_overhead.py --device cuda --amp fp16 --width 4096 --rounds 10

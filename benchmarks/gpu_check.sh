#!/usr/bin/env bash
# The GPU checks as one command, for a GPU machine as it is: nothing is installed (the checkout goes on
# PYTHONPATH), and only what that machine has is used (torch, triton, numba, pytest, transformers, tensorboard;
# no plotly, ipywidgets or nbmake). Tested there: Python 3.12, torch 2.11 + CUDA 13.0, triton 3.6.
#
#   bash benchmarks/gpu_check.sh [--out DIR]           # on the GPU machine: about 5 minutes on one H200
#   bash benchmarks/gpu_check.sh --device cpu          # the same steps on a CPU, small (a dry run, ~3 minutes)
#
# 1. versions and the device;
# 2. the tests marked gpu (Triton kernel and torch path == an independent oracle for every dtype; recorded steps
#    with no host sync under torch.cuda.set_sync_debug_mode("error"); training bit-identical with and without
#    ampviz; fp16 + GradScaler and bf16); on the CPU the kernel runs in Triton's interpreter;
# 3. the counting kernels alone (microseconds per step) and the capture benchmark's ratios (no capture, read
#    floor, ampviz variants, TensorBoard), fp16 + GradScaler and bf16;
# 4. the GPU recordings the lessons show (GPT-2-small-sized, fp16 + GradScaler and bf16), into --out.
# Each step prints its wall time; a failing step does not stop the later ones, and the exit status says whether
# any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
device=cuda
out=${OUT:-gpu_check_out}
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (use --device cuda|cpu, --out DIR)" >&2; exit 2 ;;
  esac
done
case "$device" in cuda|cpu) ;; *) echo "gpu_check.sh: --device: expected cuda or cpu, got '$device'" >&2; exit 2 ;; esac
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 AMPVIZ_TEST_DEVICE="$device"
py=$(command -v python3 || command -v python)
failed=()

stage() {      # stage NAME COMMAND...: run it, time it, remember a failure
  local name=$1; shift
  local t0=$SECONDS
  echo; echo "== $name"
  "$@" 2>&1 | tee -a "$out/gpu_check.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: rc $rc, $((SECONDS - t0)) s"
  [ "$rc" = 0 ] || failed+=("$name")
}

if [ "$device" = cuda ]; then
  size=small; steps=3000; seconds=75; bench=(--rounds 8 --warmup 2); width=4096
else   # the dry run: Triton's interpreter, small sizes, the kernel forced into the Recorder
  export TRITON_INTERPRET=1
  size=tiny; steps=6; seconds=30; bench=(--rounds 2 --warmup 1 --workload mlp); width=64
fi

stage "versions" "$py" -c "
import sys, torch
print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda)
try:
    import triton; print('triton', triton.__version__)
except ImportError:
    print('triton: not installed (the torch path counts)')
if '$device' == 'cuda':
    assert torch.cuda.is_available(), 'no CUDA device'
    print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
import ampviz; print('ampviz', ampviz.__version__, 'from', ampviz.__file__)"

# on the CPU the Recorder counts with the kernel (in the interpreter) for the tests; numba elsewhere
counter=$([ "$device" = cpu ] && echo triton || echo "${AMPVIZ_COUNTER:-}")
stage "gpu tests" env AMPVIZ_COUNTER="$counter" "$py" -m pytest -p no:cacheprovider -p no:nbmake -o addopts="" -m gpu -q -rs \
  tests/test_gpu.py tests/integrations/test_transformers.py

if [ "$device" = cuda ]; then
  stage "counting kernels alone" "$py" benchmarks/count_speed.py --device cuda --width "$width"
fi
for amp in fp16 bf16; do
  stage "capture benchmark, $amp" "$py" benchmarks/capture_overhead.py --device "$device" --amp "$amp" \
    --width "$width" "${bench[@]}"
done

stage "recordings for the lessons" "$py" lessons/data/make_gpu_recordings.py --device "$device" --size "$size" \
  --steps "$steps" --seconds "$seconds" --out "$out" $([ "$device" = cpu ] && echo "--seq 32 --batch 4")

echo
if [ ${#failed[@]} -eq 0 ]; then
  echo "gpu_check: every step passed ($SECONDS s); outputs in $out"
else
  echo "gpu_check: FAILED: ${failed[*]} ($SECONDS s); log in $out/gpu_check.log"
  exit 1
fi

#!/usr/bin/env bash
# The GPU half of docs/benchmarks.md: batched clients against the sequential engine, and the engine against a
# tight loop, for ResNet-18 at full width (CIFAR-shaped random data) and the small CNN, on one CUDA device.
#   scripts/gpu_bench.sh [PYTHON]      PYTHON: an interpreter with torch (CUDA build) and fedlase's dependencies
# Writes benchmarks-gpu.md into $OUT (or the current folder). About 3-5 minutes on a recent GPU.
set -euo pipefail
PY=${1:-python3}
cd "$(dirname "$0")/.."
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_bench: torch sees no CUDA device')"
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
# batched first: it is the figure still missing; overhead second, as time allows
"$PY" -m fedlase bench --device cuda --quick --only batched,overhead --out "${OUT:-.}/benchmarks-gpu.md"

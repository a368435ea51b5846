#!/usr/bin/env bash
# Issue 28, a GPU node: the 4-node loopback round on device=cuda with the nodes' warm workers (the CUDA context
# and the partition kept on the device across messages) and without them (a CUDA context and a copy of the
# partition in every ClientApp process). Prepared, not run: no GPU machine was lent when it was written.
# Run from the repository root on a machine with one CUDA GPU and nginx:  bash scripts/flower-worker-gpu.sh
set -euo pipefail
export FEDLASE_CACHE="${FEDLASE_CACHE:-runs/gpu-worker/cache}"
D="dataset=digits system={1,1/4}_{2,2} participation=1 local_steps=2 rounds=4 eval_every=1 threads=1 seed=0 device=cuda"
for v in worker no-worker; do
    rm -rf "runs/gpu-worker/$v" "runs/gpu-worker/$v-embedded"
    flag=(); [[ $v == no-worker ]] && flag=(--no-worker)
    echo "== $v"
    python -m tools.flower_profile $D "out=runs/gpu-worker/$v" "${flag[@]}" 2>&1 | grep -E "^(run|query|train|weights)"
done

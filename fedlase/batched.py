"""Batched clients (`batched_clients: true`): the sampled clients of a round train together, one vmapped pass
per local step, instead of one after another.

Every parameter is stacked over clients (C, *shape), as are masks, thresholds (one tau per client) and
buffers and training-time scales (HeteroFL's per-level scaler). One step is `vmap(functional_call)` over the
stack, then one backward of the SUM of the clients' losses: client c's loss depends only on slice c, so slice c of the
gradient is exactly client c's own gradient. SGD (momentum, weight decay) and AdamW act per coordinate, so a
plain torch optimizer over the stacked tensors keeps exactly per-client state (AdamW's step count is shared,
and all clients step together). Batch-statistics BN under vmap normalises each client's batch on its own.

Ragged rounds: a vmapped step needs every client's batch to have the same size. Clients are grouped by their
sequence of batch sizes (and by which parameters carry thresholds, since the masking op differs); each group
is one batched pass and a group of one client runs the sequential `local_train`.

Width slices (`Submodel.slices`, sliced=true): the stacked tensors must have one shape, so clients are also
grouped by their slice; a group trains its gathered smaller tensors together and each delta is scattered
back. Clients of one level share a slice (FedAvg-small: every client), so a round's groups are its levels; a
level with a single client trains alone with the sequential `local_train` (sliced too). A balanced partition, or
`local_steps * batch_size` within every client's data, gives one group.

Label split (`label_split=true`): each client trains its own submodel (its level's, restricted to its classes'
classifier rows: `ClientTrainer.submodel`), so its row masks stack with the rest, and its logit mask is one more
stacked input of the vmapped loss; the runner credits each client with its own submodel, as the sequential one.

The result equals the sequential engine's up to float rounding (a batched conv sums in another order); the
batches and augmentation draws are exactly the sequential ones. See docs/benchmarks.md for when it pays."""
from __future__ import annotations

import weakref
from collections.abc import Callable
from copy import deepcopy

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from .errors import ConfigError
from .layers import BatchNorm, Dropout
from .masks import Submodel
from .train import LocalWork, has_tied_weights, label_mask_logits, make_optimizer, task_loss

_TRAINING_COPIES: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()


def _without_running_stats(model: nn.Module) -> nn.Module:
    """A copy of the model whose BN layers keep no running statistics. In training BN normalises with batch
    statistics either way, so the outputs are the same; but updating running stats under vmap fails
    (momentum=None reads the batch count with float()), and local training discards them anyway."""
    if model not in _TRAINING_COPIES:
        copy = deepcopy(model)
        for m in copy.modules():
            if isinstance(m, BatchNorm) and m.track_running_stats:
                m.track_running_stats = False
                m.running_mean = m.running_var = m.num_batches_tracked = None
        _TRAINING_COPIES[model] = copy
    return _TRAINING_COPIES[model]


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.detach() for t in tensors])


def local_train_batched(model: nn.Module, global_params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                        subs: list[Submodel], x: torch.Tensor, y: torch.Tensor, batches: list[list[torch.Tensor]],
                        work: LocalWork, augments: list[Callable | None] | None = None,
                        classes: list[torch.Tensor] | None = None) -> list[tuple[dict, float]]:
    """`local_train` for C clients at once: client c trains subs[c] on batches[c] (index tensors into x, y),
    its loss masking the logits outside classes[c] (a bool vector over the classes) when `classes` is given.
    Every client's t-th batch must have the same size, and for each parameter either every client or none
    carries a threshold (with one `ste`). Returns each client's (delta, mean loss), as `local_train` does."""
    C, steps = len(subs), len(batches[0])
    if any(len(b) != steps for b in batches):
        raise ValueError("every client of a batched group needs the same number of steps")
    dev = next(iter(global_params.values())).device
    model = _without_running_stats(model)
    params = {n: g.detach().expand(C, *g.shape).clone().requires_grad_(True) for n, g in global_params.items()}
    own = dict(model.named_buffers())   # without running statistics; functional_call's default for a missing key
    bufs = {n: _stack([{**own, **buffers, **s.buffers}[n] for s in subs]).to(dev) for n in own}

    if subs[0].slices:   # one slice for the whole group (grouped so): train the gathered smaller tensors
        sl = subs[0]
        outs = local_train_batched(model, sl.gather(global_params), sl.gather(buffers), [s.inner() for s in subs],
                                   x, y, batches, work, augments, classes)
        return [(s.scatter(d, global_params), loss) for s, (d, loss) in zip(subs, outs)]
    stacked = Submodel.stack(subs, global_params)   # every client's masked forward in one
    tie = has_tied_weights(model)
    keep = None if classes is None else torch.stack([c.to(dev) for c in classes])   # (C, classes): label split

    def client_loss(p, b, xb, yb, keep):
        if work.precision == "bf16":   # autocast does not reach into vmap: the forward cast to bf16 by hand
            p, b, xb = _bf16(p), _bf16(b), xb.to(torch.bfloat16)
        logits = functional_call(model, (p, b), (xb,), tie_weights=tie).float()
        if work.task != "classify":   # a registered task's own loss (task=lm)
            return task_loss(work, logits, xb, yb, None)
        return F.cross_entropy(logits if keep is None else label_mask_logits(logits, keep), yb)

    batched_loss = vmap(client_loss, in_dims=(0, 0, 0, 0, None if keep is None else 0))
    opt = make_optimizer(list(params.values()), work)
    model.train()
    total = torch.zeros(C, dtype=torch.float64, device=dev)
    for t in range(steps):
        xs = []
        for c in range(C):
            xb = x[batches[c][t]]
            if augments is not None and augments[c] is not None:
                xb = augments[c](xb)
            xs.append(xb)
        ys = torch.stack([y[batches[c][t]] for c in range(C)])
        losses = batched_loss(stacked.apply(params, train=True), bufs, torch.stack(xs), ys, keep)   # (C,)
        opt.zero_grad(set_to_none=True)
        losses.sum().backward()
        if work.clip_norm is not None:
            _clip_each_client(list(params.values()), work.clip_norm)
        opt.step()
        total += losses.detach().double()
    out = []
    with torch.no_grad():
        masks = stacked.masks
        deltas = {n: (p - global_params[n]) * masks[n] if n in masks else p - global_params[n]
                  for n, p in params.items()}
        mean_loss = (total / max(steps, 1)).tolist()
        for c in range(C):
            out.append(({n: d[c] for n, d in deltas.items()}, mean_loss[c]))
    return out


def _clip_each_client(stacked: list[torch.Tensor], max_norm: float) -> None:
    """`clip_grad_norm_` for each client on its own: slice c of every stacked gradient scaled by
    min(1, max_norm / (norm + 1e-6)), the norm over all of client c's slices (torch's rule and epsilon)."""
    grads = [p.grad for p in stacked if p.grad is not None]
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads]).norm(dim=0)   # (C,)
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))


def _bf16(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Floating tensors as bf16 (differentiable: the fp32 parameters get fp32 gradients), others as they are."""
    return {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in tensors.items()}


def _slice_key(sub: Submodel) -> tuple:
    """Equal for submodels with the same slices (same kept indices everywhere), so they can stack."""
    return tuple((n, tuple(None if i is None else tuple(i.tolist()) for i in sl))
                 for n, sl in sorted(sub.slices.items()))


def dropout_refused(model: nn.Module) -> str | None:
    """Why `model` cannot train batched, or None: dropout's random draws under vmap cannot match the sequential
    ones."""
    if any(isinstance(m, Dropout) and m.p > 0 for m in model.modules()):
        return "the model uses dropout, whose random draws under vmap cannot match the sequential ones; " \
               "set batched_clients=false"
    return None


def train_clients_batched(trainer, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                          picked: list, subs: list[Submodel], rnd: int) -> list[tuple[dict, float]]:
    """(delta, loss) of every picked (client, level), in `picked` order, trained group by group with the
    trainer's model, data and batches (`ClientTrainer` of fedlase/client.py). subs[i]: the submodel picked[i]
    trains (`ClientTrainer.submodel`: its level's, or under label_split its own)."""
    if why := dropout_refused(trainer.model):
        raise ConfigError("batched_clients", why)
    if any(s.local is not None for s in subs):   # a method's own local objective is sequential only
        raise ConfigError("batched_clients", "this method trains with its own local objective (Submodel.local), "
                          "which the vmapped step does not run; set batched_clients=false")
    jobs = [trainer.job(client, rnd) for client, _ in picked]
    # sliced=false: masks over the full model; once per distinct submodel (clients of a level share theirs
    # unless label_split gives each its own), and so is its group key
    trained, keys = {}, {}
    for s in subs:
        if id(s) not in trained:
            t = trained[id(s)] = trainer.trained(s)
            keys[id(s)] = (frozenset(t.thresholds or ()), t.ste if t.thresholds else None, _slice_key(t))
    groups: dict[tuple, list[int]] = {}
    for i, (batches, _) in enumerate(jobs):
        groups.setdefault((tuple(len(b) for b in batches), keys[id(subs[i])]), []).append(i)
    classes = trainer.classes   # label_split: each client's classes, its logit mask
    results: list = [None] * len(picked)
    for members in groups.values():
        if len(members) == 1:   # nothing to batch with: the sequential code, exactly
            i = members[0]
            results[i] = trainer.update(picked[i][0], params, buffers, subs[i], rnd)
            continue
        outs = local_train_batched(trainer.model, params, buffers, [trained[id(subs[i])] for i in members],
                                   trainer.x, trainer.y, [jobs[i][0] for i in members], trainer.work,
                                   [jobs[i][1] for i in members],
                                   None if classes is None else [classes[picked[i][0]] for i in members])
        for i, o in zip(members, outs):
            results[i] = o
    return results

"""What each resource level of a run really costs a client (`fedlase cost CONFIG`; issue 30).

This module knows no Experiment: it costs a run's parts (fedlase.engine.build_parts: model, method, client
trainer, levels); fedlase/simtime.py's clock and fedlase/measure.py build them for a config.
Per level, on the submodel of round 1 of the initial model (or of the model a checkpoint holds):
  held        trainable parameters the client must hold to train: the whole model for masked methods (FIARSE,
              FedLASE: the client trains the full-size tensors under masks), the gathered slice for width methods
              (HeteroFL, FedRolex, fedlase_width), BatchNorm parameters included; a LoRA client's adapter;
  frozen      frozen parameters it holds besides (requires_grad False: a LoRA run's base, which every client holds
              whole and runs whole forward and backward, whatever its rank);
  optimizer   bytes of the local optimizer's state for the held parameters (AdamW: two moments; SGD with momentum:
              one buffer; plain SGD: none);
  activations bytes autograd keeps for the backward of one local step (every tensor saved for backward, counted
              once per storage, the parameters aside), measured on the step below;
  memory      the estimate of what training needs at once: frozen + held weights, the held parameters'
              gradients, the optimizer state and the activations. The simulated clock's `over_memory` reads it where
              no peak is measured;
  kept        budgeted coordinates of its submodel (what the budget counts), and their share of the model's:
              a method that defines a level by width (HeteroFL) can keep far more than the level's fraction;
  step_flops  FLOPs of one local step (forward and backward of one batch) as fedlase computes it, counted by
              torch.utils.flop_counter.FlopCounterMode (matmuls and convolutions only; BN, activations and the
              optimizer are not counted); with a frozen base, its whole forward and the activation gradients
              through it, then the trainable part's own gradients;
  sparse      the FLOPs of that step if the submodel's sparsity were exploited: each conv or linear layer's
              counted FLOPs (forward, weight gradient and input gradient) times the kept fraction of its weight,
              every operation counted in one layer at most (`_LayerFlops`); what no masked layer computes
              (attention's products, unmasked layers) stays whole; equal to step_flops for a slice, which
              already computes only what it keeps;
  down / up   payload bytes each way as the Flower codec sends them (fedlase/payload.py: kept values, mask
              bits, slice indices, buffers; up: the delta on the credited mask); trainable parameters only, so a
              LoRA client's are its adapter's;
  peak        peak resident memory of one client's local training (all its steps), MEASURED in a fresh child
              process per level: after the process has loaded the data and built the model, its high-water mark
              is reset (Linux /proc/self/clear_refs, "5") and read back after training (VmHWM). Reported as the
              whole process's peak and as `train+`, the peak above the resident size just before training (the
              training's own working set: parameter copies, activations, gradients, optimizer state).
              Caveats: RSS counts pages, not tensors (the allocator may keep freed memory, so repeated steps do
              not add up); the process's baseline (Python, torch, the dataset) is in `peak`; where clear_refs
              cannot be written the high-water mark includes the setup (then `train+` is a lower bound).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["LEGEND", "LevelCost", "format_cost_table", "level_costs", "measure_memory", "with_memory"]


@dataclass
class LevelCost:
    level: str            # the level's name (1, 1/4, ...)
    fraction: float
    held: int             # parameters held to train
    kept: int             # budgeted coordinates of the submodel
    step_flops: int       # one local step as fedlase computes it
    sparse_flops: int     # the same step with the submodel's sparsity exploited
    down_bytes: int
    up_bytes: int
    steps: int            # local steps of one round (its first client's)
    sliced: bool          # whether the client trains a gathered slice
    peak_bytes: int | None = None
    train_bytes: int | None = None
    share: float | None = None   # kept / the model's budgeted coordinates
    # with defaults, so that a cost table recorded before them (a run's sim.json) still reads
    frozen: int = 0                      # frozen parameters held besides (a LoRA run's base)
    optimizer_bytes: int = 0
    activation_bytes: int | None = None
    memory_bytes: int | None = None      # the estimate: weights, gradients, optimizer state, activations

    @property
    def need_bytes(self) -> int | None:
        """What training at this level needs: the measured peak where there is one, else the estimate."""
        return self.peak_bytes if self.peak_bytes is not None else self.memory_bytes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def representative(level_clients: dict, lvl) -> int:
    """The client a level is costed on: its first (client 0 when it has none)."""
    return (level_clients.get(lvl) or [0])[0]


def trained_submodel(method, trainer, params: dict, client: int, lvl, rnd: int = 1):
    """(the level's submodel, the client's own, that one as the client trains it) at round `rnd`."""
    sub = trainer.submodel(client, method.submodel(params, lvl, rnd), params)
    return sub, trainer.trained(sub)


class _SavedBytes:
    """Bytes of the tensors autograd saves for backward, each storage once: a step's activations. Leaves (the
    parameters, a frozen base's weights, the input ids) and views of them are left out: they are held anyway; a
    masked method's masked weights count, as they live through the step too."""

    def __init__(self, model):
        self.skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        base = t._base if t._base is not None else t
        if not base.is_leaf:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.skip:
                self.seen[ptr] = t.untyped_storage().nbytes()
        return t

    @property
    def total(self) -> int:
        return int(sum(self.seen.values()))


class _LayerFlops(FlopCounterMode):
    """FLOPs of a step, in all and per layer that owns a weight of `names` (a conv or linear layer, under its
    weight's name; a tied weight's layers count under the one name). FlopCounterMode's own per-module counts
    cannot be scaled by layer: in the backward it holds a module open from its output's gradient until its
    input's whole gradient is summed, so where that input feeds another branch too (a ResNet shortcut beside its
    block's convs; a BERT layer's query, key and value reading one hidden state; a residual) the other branch's
    backward counts in the module as well, the layers' counts add up to more than the step, and the sparse FLOPs
    came out negative. Here each operation counts in one layer at most: in the forward, the innermost layer
    running; in the backward, the layer whose forward created the autograd node being run."""

    def __init__(self, model, names):
        super().__init__(display=False)
        owner = {id(p): n for n, p in model.named_parameters()}
        own = ((m, dict(m.named_parameters(recurse=False)).get("weight")) for m in model.modules())
        self.layers = {m: owner[id(w)] for m, w in own if w is not None and owner.get(id(w)) in names}
        self.total, self.per_layer = 0, dict.fromkeys(self.layers.values(), 0)
        self.running: list[tuple[str, int | None]] = []   # (layer, its start) of the layers running, innermost last
        self.created: dict = {}                           # autograd node -> the layer whose forward created it

    def _count_flops(self, func_packet, out, args, kwargs):   # FlopCounterMode's counting, attributed as above
        if func_packet in self.flop_registry:
            flops = self.flop_registry[func_packet](*args, **kwargs, out_val=out)
            node = torch._C._current_autograd_node()   # the node a backward runs (None in a forward): no public name
            if node is not None:
                layer = self.created.get(node)
            else:
                layer = self.running[-1][0] if self.running else None
            self.total += flops
            if layer is not None:
                self.per_layer[layer] += flops
        return out

    def _enter(self, module, args):
        mark = torch.zeros((), requires_grad=True).view(())   # the latest autograd node before the layer runs
        self.running.append((self.layers[module], mark.grad_fn._sequence_nr() if mark.grad_fn else None))

    def _leave(self, module, args, out):
        name, start = self.running.pop()
        if start is None:   # no graph (no_grad)
            return
        # the layer's own nodes: reached from its output, made after _enter (sequence numbers rise)
        todo = [t.grad_fn for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
        seen = set()
        while todo:
            node = todo.pop()
            if node is None or node in seen or node._sequence_nr() <= start:
                continue
            seen.add(node)
            self.created.setdefault(node, name)   # an inner layer's nodes stay its own
            todo.extend(n for n, _ in node.next_functions)

    def __enter__(self):
        self.hooks = [h for m in self.layers for h in (m.register_forward_pre_hook(self._enter),
                                                        m.register_forward_hook(self._leave))]
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        for h in self.hooks:
            h.remove()
        self.created.clear()
        return out


def _step_flops(model, trainer, params: dict, buffers: dict, client: int, trained) -> tuple[int, int, int]:
    """(FLOPs of one local step, the same with each layer's FLOPs times its weight's kept fraction, the bytes
    autograd keeps for the step's backward)."""
    from .train import local_train
    batches, augment = trainer.job(client, 1)
    one = dataclasses.replace(trainer.work, steps=1, epochs=None)
    classes = trainer.classes[client] if trainer.classes is not None else None
    masks = trained.inner().masks if trained.slices else trained.masks   # a slice's inner masks, if any
    saved = _SavedBytes(model)
    with torch.random.fork_rng(), _LayerFlops(model, masks) as counter, \
            torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        local_train(model, params, buffers, trained, trainer.x, trainer.y, batches[:1], one, augment, classes)
    # a layer's counted FLOPs (forward, weight gradient, input gradient) scale with its weight's density
    skipped = sum(flops * (1.0 - float(masks[name].float().mean())) for name, flops in counter.per_layer.items())
    return counter.total, int(round(counter.total - skipped)), saved.total


def _payload(params: dict, buffers: dict, sub, own: dict | None = None) -> tuple[int, int]:
    """Bytes down and up as the Flower codec sends them (fedlase/payload.py, torch alone: the same with or without
    the `flower` extra). A method's own local objective (FjORD's widths, DepthFL's exits, FedDSE's scoring) is not
    sent, the node rebuilds it: such a submodel is charged its arrays as any other; the tensors of its own a reply
    holds beside the delta (`own`: `Method.own_reply`, FedDSE's channel choice) are charged with it. A personal
    objective (pFedLMT's) only swaps the client's own values into the submodel's tensors, at their sizes: it is
    charged the submodel without it, i.e. the level's model each way (the authors' server keeps the parts and
    sends them)."""
    from .payload import delta_arrays, payload_bytes, submodel_arrays
    if sub.local is not None and sub.local.personal:
        sub = dataclasses.replace(sub, local=None)
    reply = {n: torch.zeros_like(p) for n, p in params.items()}
    reply.update({n: torch.zeros(shape, dtype=dtype) for n, (shape, dtype) in (own or {}).items()})
    return payload_bytes(submodel_arrays(params, buffers, sub)), payload_bytes(delta_arrays(reply, sub))


def level_costs(model, method, trainer, levels, level_clients: dict, params: dict | None = None,
                buffers: dict | None = None) -> list[LevelCost]:
    """The cost of every level (largest first) of a run's parts (fedlase.engine.build_parts), on the global model
    `params`/`buffers` (default: the model's own, the initial one). The method's own state is restored afterwards
    (costing starts a client's local objective, which may touch it), so a run's results do not change. The peak
    memory is measured apart (`measure_memory`, a child process per level)."""
    from .train import trainable
    # the trainable parameters, as a run's state holds them; a frozen base stays in the module
    params = params if params is not None else {k: v.detach() for k, v in trainable(model).items()}
    buffers = buffers if buffers is not None else {k: v.detach() for k, v in model.named_buffers()}
    frozen = [p for p in model.parameters() if not p.requires_grad]
    frozen_n, frozen_bytes = sum(p.numel() for p in frozen), sum(p.numel() * p.element_size() for p in frozen)
    state = copy.deepcopy(method.state_dict())
    total = sum(params[n].numel() for n in method.maskable if n in params)
    out = []
    try:
        for lvl in levels:
            client = representative(level_clients, lvl)
            sub, trained = trained_submodel(method, trainer, params, client, lvl)
            tensors = trained.gather(params) if trained.slices else params
            held = sum(t.numel() for t in tensors.values())
            weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            flops, sparse, activations = _step_flops(model, trainer, params, buffers, client, trained)
            down, up = _payload(params, buffers, sub, method.own_reply(lvl))
            steps = trainer.work.num_steps(len(trainer.train_idx[client]))
            kept = sub.kept([n for n in method.maskable if n in params], params)
            opt = weight_bytes * optimizer_states(trainer.work)
            memory = frozen_bytes + 2 * weight_bytes + opt + activations   # weights, gradients, optimizer, activations
            out.append(LevelCost(lvl.name, float(lvl), held, kept, flops, sparse, down, up, steps,
                                 bool(trained.slices), share=kept / total if total else None, frozen=frozen_n,
                                 optimizer_bytes=opt, activation_bytes=activations, memory_bytes=memory))
    finally:
        method.load_state_dict(state)
    return out


def optimizer_states(work) -> int:
    """Tensors of the local optimizer's state per trained tensor: AdamW's two moments, SGD's momentum buffer."""
    if work.optimizer == "adamw":
        return 2
    return 1 if work.momentum else 0


def with_memory(costs: list[LevelCost], cfg, checkpoint: str | None = None) -> list[LevelCost]:
    """`costs` with each level's peak memory of local training measured (a child process per level;
    `checkpoint`: the params it loads)."""
    for i, c in enumerate(costs):
        c.peak_bytes, c.train_bytes = measure_memory(cfg, i, checkpoint)
    return costs


# ---- measured memory ------------------------------------------------------------------------------------------
def measure_memory(cfg, level_index: int, checkpoint: str | None = None) -> tuple[int | None, int | None]:
    """(peak RSS bytes, bytes above the RSS before training) of one client's local training at a level, in a
    fresh child process (so no other level's pages are counted)."""
    spec = json.dumps({"config": cfg.to_dict(), "level": level_index, "checkpoint": checkpoint}, default=str)
    proc = subprocess.run([sys.executable, "-c", "from fedlase.measure import memory_child; memory_child()"],
                          input=spec, capture_output=True, text=True)
    if proc.returncode != 0:
        return None, None
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return got["peak"], got["train"]


# ---- the table --------------------------------------------------------------------------------------------------
def _si(x: float | None, unit: str = "") -> str:
    if x is None:
        return "n/a"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.2f} {prefix}{unit}".rstrip()
    return f"{x:.0f} {unit}".rstrip()


def _mib(x: int | None) -> str:
    return "n/a" if x is None else f"{x / 2 ** 20:.1f} MiB"


# the columns of format_cost_table, printed under it by `fedlase cost`
LEGEND = """\
params held    parameters a client holds to train: dense, the whole model under masks; slice, the gathered slice
frozen base    frozen parameters every client of the level holds besides, whole (a LoRA run's base; shown if any)
kept (budget)  budgeted coordinates of the level's submodel, and their share of the model's budgeted ones
optimizer      the local optimizer's state for the held parameters (AdamW: two moments; SGD: its momentum) (MiB)
activations    what autograd keeps for the backward of one local step, measured on the step (MiB)
memory (est.)  frozen base + held weights + their gradients + optimizer + activations (MiB; a lower bound)
peak RSS       measured peak resident memory of one client's local training, the whole process (MiB = 2^20 bytes;
               n/a: not measured: --no-memory, or the measuring process failed)
train+         the part of that peak above the process's resident size just before training (MiB)
step FLOPs     floating-point operations of one local step (forward and backward of one batch), matmuls and
               convolutions only (k, M, G, T: 10^3, 10^6, 10^9, 10^12)
sparse FLOPs   the same step if the submodel's sparsity were exploited
down, up       bytes sent to the client and back in one round, as Flower's codec sends them (kB = 10^3 bytes)
steps          local steps of one round"""   # printed under `fedlase cost`'s table (the module docstring says more)


def format_cost_table(costs: list[LevelCost], method: str = "") -> str:
    """The per-level Markdown table."""
    rows = []
    base = any(c.frozen for c in costs)   # a frozen base: its size, and what the estimate adds up
    for c in costs:
        share = "" if c.share is None else f" ({100 * c.share:.3g}%)"   # what the level really keeps
        frozen = [f"{c.frozen:,}"] if base else []
        rows.append([c.level, f"{c.held:,}" + (" (slice)" if c.sliced else " (dense)"), *frozen, f"{c.kept:,}{share}",
                     _mib(c.optimizer_bytes), _mib(c.activation_bytes), _mib(c.memory_bytes),
                     _mib(c.peak_bytes), _mib(c.train_bytes), _si(c.step_flops, "FLOP"), _si(c.sparse_flops, "FLOP"),
                     _si(c.down_bytes, "B"), _si(c.up_bytes, "B"), str(c.steps)])
    head = ["level", "params held", *(["frozen base"] if base else []), "kept (budget)", "optimizer", "activations",
            "memory (est.)", "peak RSS", "train+", "step FLOPs", "sparse FLOPs", "down", "up", "steps"]
    title = (f"Cost per level{' (' + method + ')' if method else ''}: one local step of one batch; memory (est.) = "
             f"{'frozen base + ' if base else ''}held weights + their gradients + optimizer + activations; "
             "peak = measured\n\n")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return title + "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])

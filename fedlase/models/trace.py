"""Channel groups derived by tracing, for a model that declares no `channel_groups()`.

Width methods (HeteroFL, FedRolex, FedAvg-small, FjORD, FedDSE, fedlase_width) cut channels in groups: per
parameter, the channel group of its dim 0 and of its dim 1 (`fedlase/slicing.py`). A model may declare
them (`channel_groups()`, `group_units()`, `sliceable`); its own hooks always win. Where it declares none, they are
derived here, once, from Torch-Pruning's dependency graph (PyPI `torch-pruning`, DepGraph): a trace of one forward
pass on two training samples, which the run keeps with its model (fedlase/model_facts.py, where the result is kept
too: nothing is set on the model).

The mapping (docs/methods-structured.md, "Groups derived by tracing"):
- every Torch-Pruning group (the channels cut together: a layer's outputs, the BatchNorm/LayerNorm after it, the
  inputs of the layers it feeds, and every producer tied to them by a residual addition) becomes one fedlase group,
  named after its first member, `"<parameter>:<dim>"`;
- a group whose channels reach the model's output (the classes) is never cut (None), nor one that meets a layer
  fedlase cannot cut by rows and columns (grouped or transposed convolutions, attention with packed projections,
  recurrent layers, bare parameters), nor one whose channels do not map one to one onto every member: a
  concatenation (a layer reading [a, b] sees a's channels at an offset) or a flatten of a feature map into a
  linear layer (one channel becomes h*w inputs) has no (output group, input group) form, so those channels stay
  whole;
- sliced or masked: the model trains as the physically smaller tensors (`sliceable`) only where a trial on the
  same two samples shows the half-width slice, run as smaller tensors, gives the same logits as the masks over
  the full model (a forward that reads a size from a layer's attributes, a view with a fixed size, a LayerNorm
  or GroupNorm over cut channels fail it); otherwise it trains masked, once a forward with hooks has shown that
  under the masks every layer's kept input channels, and only those, carry its producers' kept channels. A model
  that moves channels between a producer and its consumer (a channel shuffle by view and transpose, `flip(1)`,
  `roll(..., dims=1)`, indexing with a permutation) passes the trace as one to one; it fails that check and is
  refused in one line;
- the trial and the check above run on the prefix half-width slice when the groups are derived, and again on
  every other set of kept channels the run uses, the first time it is used (`check_kept`, called by
  fedlase/slicing.py's `width_slices`: each level's window, FedRolex's rolled ones, fedlase_width's and
  FedDSE's chosen channels): a permutation within each half, or a pair swap, keeps the prefix half in place but
  not a quarter or a rolled window. A sliced model must give its masks' logits there too.

Torch-Pruning is imported only here, and only when a width method meets a model without the hooks."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from ..errors import ConfigError
from ..layers import BatchNorm, Conv
from ..model_hooks import hook

_CACHE: dict[tuple, tuple[dict, bool]] = {}   # (class, parameter shapes, input shape, dtype) -> (groups, sliceable)
_CHECKED: set[tuple] = set()   # (that key, the kept channels of every group) already checked
_TRIAL_RATE = 0.5   # the width of the slice whose smaller-tensor forward is checked against its masks
_MOVED = "channels move between layers (a shuffle, flip, roll or permutation?)"


def derive_groups(model: nn.Module, example: torch.Tensor | None, method: str, width_slices) -> tuple[dict, bool]:
    """(channel groups, sliceable) of a model that declares no `channel_groups()`, derived by tracing it on
    `example` (its ModelFacts' samples); a one-line ConfigError naming what failed and the hook to write instead.
    Nothing is set on the model (fedlase/model_facts.py keeps the result). `width_slices`: fedlase/slicing.py's,
    handed in (slicing calls this module, so it does not import slicing back)."""
    kind = type(model).__name__
    if hook(model, "group_units") is not None:
        raise ConfigError("model", f"{method} slices channels; model {kind} declares group_units() but no "
                          "channel_groups(): write channel_groups() too (docs/library.md, 'The model protocol')")
    if example is None:
        raise ConfigError("model", f"{method} slices channels; model {kind} declares no channel_groups() and was "
                          "built outside a run (fedlase's model registry), so there is no sample to trace it with: "
                          "register it (fedlase.register_model), build the method with its facts "
                          "(Method.build(model, system, ModelFacts.of(model, data))) or write channel_groups()")
    key = _key(model, example)
    if key not in _CACHE:
        groups = trace_groups(model, example, method)
        sliceable = _slices_match(model, groups, example, method, width_slices)
        if not sliceable:   # masked training needs only that each consumer reads its producers' kept channels
            _check_channel_flow(model, groups, example, method, width_slices)
        _CACHE[key] = (groups, sliceable)
    return _CACHE[key]


def _key(model: nn.Module, example: torch.Tensor) -> tuple:
    return (type(model), tuple((n, tuple(p.shape)) for n, p in model.named_parameters()), tuple(example.shape),
            example.dtype)


def check_kept(model: nn.Module, groups: dict, sliceable: bool, example: torch.Tensor, method: str, width_slices,
               keep: dict[str, torch.Tensor]) -> None:
    """Refuse (one line) a traced model that, with the channels `keep` kept (group -> bool vector), moves channels
    between its layers: as the smaller tensors (`sliceable`) it must give its masks' logits, and under the masks
    every consumer must read its producers' kept channels on exactly its own kept inputs. Checked once per set of
    kept channels (and model class and shapes)."""
    seen = (_key(model, example), tuple(sorted((g, k.cpu().numpy().tobytes()) for g, k in keep.items())))
    if seen in _CHECKED:
        return
    if sliceable and not _slices_match(model, groups, example, method, width_slices, keep):
        kept, total = sum(int(k.sum()) for k in keep.values()), sum(k.numel() for k in keep.values())
        raise _fail(method, model, f"as the smaller tensors it differs from its masks with {kept} of its {total} "
                    f"channels kept: {_MOVED}")
    _check_channel_flow(model, groups, example, method, width_slices, keep)
    _CHECKED.add(seen)


def _trial(model: nn.Module, groups: dict, sliceable: bool) -> SimpleNamespace:
    """A stand-in for the model's ModelFacts with the groups on trial, sliced or not, whatever the model declares
    (its kept channels are the ones under check, so it checks none itself)."""
    return SimpleNamespace(model=model, channel_groups=lambda: groups, sliceable=lambda: sliceable, group_units=dict,
                           check_kept=lambda keep: None)


def _fail(method: str, model: nn.Module, what: str) -> ConfigError:
    text = " ".join(what.split())
    text = text[:200] + "..." if len(text) > 200 else text
    return ConfigError("model", f"{method} slices channels; model {type(model).__name__} declares no "
                       f"channel_groups() and tracing it failed ({text}): write channel_groups() "
                       "(docs/library.md, 'The model protocol')")


# ---- the trace ---------------------------------------------------------------------------------------------------
def _dims(module: nn.Module, name: str, out: bool) -> list[tuple[str, int, int]] | None:
    """(parameter name, dim, size) of the module's output (`out`) or input channels, or None for a layer whose
    channels are not whole rows or columns of its parameters."""
    p = f"{name}." if name else ""
    with_bias = [(f"{p}bias", 0, module.bias.shape[0])] if getattr(module, "bias", None) is not None else []
    if isinstance(module, Conv) and not module.transposed:
        w = module.weight
        if module.groups == 1:
            return [(f"{p}weight", 0, w.shape[0])] + with_bias if out else [(f"{p}weight", 1, w.shape[1])]
        if module.groups == module.in_channels == module.out_channels:   # depthwise: inputs are the outputs
            return [(f"{p}weight", 0, w.shape[0])] + with_bias
        return None
    if isinstance(module, nn.Linear):
        w = module.weight
        return [(f"{p}weight", 0, w.shape[0])] + with_bias if out else [(f"{p}weight", 1, w.shape[1])]
    if isinstance(module, (BatchNorm, nn.GroupNorm, nn.LayerNorm)):
        if isinstance(module, nn.LayerNorm) and len(module.normalized_shape) != 1:
            return None
        return [(f"{p}{k}", 0, t.shape[0]) for k, t in module.named_parameters(recurse=False)]
    if isinstance(module, nn.Embedding):
        return [(f"{p}weight", 1, module.weight.shape[1])]
    return None


def _sinks(dg) -> set:
    """The layers whose outputs are the model's outputs (through parameter-free operations)."""
    found, stack, seen = set(), [n for n in dg.module2node.values() if not n.outputs], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node.module, nn.Parameter) or list(node.module.parameters(recurse=False)):
            found.add(node.module)
        else:
            stack.extend(node.inputs)
    return found


def trace_groups(model: nn.Module, example: torch.Tensor, method: str = "width slices") -> dict[str, tuple]:
    """Parameter name -> (group of dim 0, group of dim 1) from Torch-Pruning's dependency graph of one forward
    pass of `model` on `example` (the module docstring gives the mapping). Parameters no group cuts are left out."""
    try:
        import torch_pruning as tp
    except ImportError:
        raise _fail(method, model, "torch-pruning is not installed: pip install torch-pruning") from None
    device = next(model.parameters()).device
    modes = {m: m.training for m in model.modules()}   # the trace switches the model to eval mode
    try:
        with torch.enable_grad():
            dg = tp.DependencyGraph().build_dependency(model, example_inputs=(example.to(device),), verbose=False)
    except Exception as e:   # noqa: BLE001 -- any failure of a user's model is reported in one line
        raise _fail(method, model, f"{type(e).__name__}: {e}") from None
    finally:
        for m, t in modes.items():
            m.training = t

    names = {m: n for n, m in model.named_modules()}
    parent: dict[tuple, tuple] = {}

    def find(k):
        while parent.setdefault(k, k) != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    whole: set[tuple] = set()   # a member of each group that must stay whole
    sinks = _sinks(dg)
    done: set[tuple] = set()
    for module in list(dg.module2node):
        if not isinstance(module, nn.Module) or module not in names or not list(module.parameters(recurse=False)):
            continue
        root = _dims(module, names[module], out=True)
        pruner = dg.get_pruner_of_module(module)
        if root is None or pruner is None or pruner.get_out_channels(module) is None:
            continue   # a layer fedlase cannot cut: any group it belongs to is found whole from its neighbours
        if all((n, d) in done for n, d, _ in root):
            continue
        size = root[0][2]
        group = dg.get_pruning_group(module, pruner.prune_out_channels, list(range(size)))
        members, ok = [], True
        for dep, idxs in group:
            target = dep.target.module
            if not isinstance(target, nn.Parameter) and not list(target.parameters(recurse=False)):
                continue   # an operation without parameters (add, cat, view, ...): its mapping shows downstream
            out = dep.handler.__name__ != "prune_in_channels"
            dims = None if isinstance(target, nn.Parameter) or target not in names else \
                _dims(target, names[target], out)
            if dims is None or list(idxs) != list(range(size)) or any(s != size for _, _, s in dims):
                ok = False
            members += [(n, d) for n, d, _ in dims or []]
            if target in sinks and out:
                ok = False
        keys = [(n, d) for n, d, _ in root] + members
        for k in keys:
            done.add(k)
            parent[find(k)] = find(keys[0])
        if not ok:
            whole.add(keys[0])
    whole_roots = {find(k) for k in whole}
    # a group is named after its first member in parameter order
    order = [(n, d) for n, p in model.named_parameters() for d in range(min(p.dim(), 2))]
    label: dict[tuple, str] = {}
    for n, d in order:
        if (n, d) in parent:
            label.setdefault(find((n, d)), f"{n}:{d}")
    groups: dict[str, tuple] = {}
    for n, _ in model.named_parameters():
        g = tuple(None if (n, d) not in parent or find((n, d)) in whole_roots else label[find((n, d))]
                  for d in (0, 1))
        if g != (None, None):
            groups[n] = g
    if not groups:
        raise _fail(method, model, "the trace found no channels a width slice can cut: every group reaches the "
                    "output, a concatenation, a flatten or a layer fedlase cannot cut")
    return groups


@torch.no_grad()
def _slices_match(model: nn.Module, groups: dict, example: torch.Tensor, method: str, width_slices,
                  keep: dict | None = None) -> bool:
    """Whether the slice keeping `keep` (default: the prefix half width) trained as the smaller tensors is the same
    function as its masks over the full model, on the traced samples (in eval mode, so that nothing random or
    stateful differs)."""
    from torch.func import functional_call

    from ..masks import Submodel
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    x = example.to(next(iter(params.values())).device)
    masks, slices = width_slices(_trial(model, groups, True), params, _TRIAL_RATE, keep=keep)
    sub = Submodel(masks, slices=slices)
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        try:
            full = functional_call(model, {**sub.apply(params), **buffers}, (x,))
        except Exception as e:   # noqa: BLE001
            raise _fail(method, model, f"its masked forward failed: {type(e).__name__}: {e}") from None
        try:
            small = functional_call(model, {**sub.gather(params), **sub.gather(buffers)}, (x,))
        except Exception:   # noqa: BLE001 -- a forward that takes a size from a layer's attributes: train masked
            return False
    finally:
        for m, t in modes.items():
            m.training = t
    if not isinstance(full, torch.Tensor) or not isinstance(small, torch.Tensor) or full.shape != small.shape:
        return False
    scale = float(full.abs().max()) if full.numel() else 0.0
    return bool(torch.allclose(full, small, rtol=1e-4, atol=1e-5 * max(1.0, scale)))


# ---- the channels each layer reads under the masks ----------------------------------------------------------------
def _channel_dim(module: nn.Module) -> int:
    """The dim of a layer's input and output tensors that holds its channels."""
    return 1 if isinstance(module, (Conv, BatchNorm, nn.GroupNorm)) else -1


def _kept_channels(groups: dict, masks: dict) -> dict[str, torch.Tensor]:
    """Group -> bool vector of the channels the masks keep (read off any parameter the group cuts)."""
    keep: dict[str, torch.Tensor] = {}
    for name, gs in groups.items():
        m = masks[name]
        for d, g in enumerate(gs):
            if g is not None and g not in keep:
                keep[g] = m.transpose(0, d).reshape(m.shape[d], -1).any(1)
    return keep


@torch.no_grad()
def _check_channel_flow(model: nn.Module, groups: dict, example: torch.Tensor, method: str, width_slices,
                        keep: dict | None = None) -> None:
    """Refuse (one line) a model whose layers, with the channels `keep` kept (default: the prefix half width) and
    the rest masked, read on a kept input channel no kept channel of their producers, or on a dropped one a kept
    channel. Every layer that produces a group's channels emits markers instead of its output: a random value on
    its kept channels, zero on its dropped ones (what a masked layer emits there), so what each consumer reads
    depends on the model's wiring alone, not on its weights. Two forwards with other markers on the kept channels
    tell which of a consumer's inputs carry them: exactly its kept ones must change. What a dropped channel
    becomes on its way (0.5 after a sigmoid) is the same in both, as in the masked model, whose consumer ignores
    it (its weights there are masked)."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    if keep is None:
        keep = _kept_channels(groups, width_slices(_trial(model, groups, False), params, _TRIAL_RATE)[0])
    keep = {g: k.cpu() for g, k in keep.items()}
    inputs: list[dict[str, list[torch.Tensor]]] = [{}, {}]   # per forward: consumer -> its inputs, call by call

    def along(v: torch.Tensor, dim: int, ndim: int) -> torch.Tensor:
        shape = [1] * ndim
        shape[dim] = -1
        return v.view(shape)

    def produce(g, gen):
        def hook(mod, _inp, out):
            dim = _channel_dim(mod)
            if not isinstance(out, torch.Tensor) or out.dim() < 2 or out.shape[dim] != keep[g].numel():
                return None
            marks = torch.rand(out.shape, generator=gen).to(out) + 0.5
            return marks * along(keep[g].to(out.device), dim % out.dim(), out.dim())
        return hook

    def consume(name, g, seen):
        def hook(mod, inp):
            x, dim = inp[0] if inp else None, _channel_dim(mod)
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[dim] == keep[g].numel():
                seen.setdefault(name, []).append(x.movedim(dim, 0).reshape(x.shape[dim], -1).cpu())
        return hook

    layers = []   # (name, module, its input group, its output group)
    for name, mod in model.named_modules():
        gs = groups.get(f"{name}.weight" if name else "weight")
        if gs is None or not isinstance(mod, (Conv, nn.Linear, BatchNorm, nn.GroupNorm, nn.LayerNorm, nn.Embedding)):
            continue
        channelwise = not isinstance(mod, (Conv, nn.Linear)) or getattr(mod, "groups", 1) > 1   # norms, depthwise
        out_g = gs[1] if isinstance(mod, nn.Embedding) else gs[0]
        in_g = None if isinstance(mod, nn.Embedding) else gs[0] if channelwise else gs[1]
        layers.append((name, mod, in_g, out_g))
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        for seed, seen in enumerate(inputs):
            gen = torch.Generator().manual_seed(seed)
            handles = []
            try:
                for name, mod, in_g, out_g in layers:
                    if in_g is not None:
                        handles.append(mod.register_forward_pre_hook(consume(name, in_g, seen)))
                    if out_g is not None:
                        handles.append(mod.register_forward_hook(produce(out_g, gen)))
                model(example.to(next(iter(params.values())).device))
            except Exception as e:   # noqa: BLE001
                raise _fail(method, model, f"its forward with channel markers failed: {type(e).__name__}: {e}") \
                    from None
            finally:
                for h in handles:
                    h.remove()
    finally:
        for m, t in modes.items():
            m.training = t
    for name, _, in_g, _ in layers:
        for a, b in zip(inputs[0].get(name, []), inputs[1].get(name, [])):
            fed = (a != b).any(1)   # the input channels that carry a producer's kept channels
            dead, stray = int((keep[in_g] & ~fed).sum()), int((~keep[in_g] & fed).sum())
            if dead or stray:
                raise _fail(method, model, f"{name} reads {dead} of its {int(keep[in_g].sum())} kept input channels "
                            f"from no kept channel and {stray} dropped ones from kept channels: {_MOVED}")

"""What fedlase learns about a run's model, kept beside it, never set on it: `ModelFacts`.

A model's own hooks say most of it (`channel_groups()`, `group_units()`, `sliceable`: fedlase/model_hooks.py,
docs/library.md "The model protocol"), and they always win. What a model does not declare fedlase finds out and
keeps here: the channel groups and the sliced-or-masked decision derived by tracing it (fedlase/models/trace.py),
and the two training samples the trace runs on. fedlase.engine.build_parts builds them with the model
(`ModelFacts.of`, `Parts.facts`) and hands them to the method (`Method.build`), which reads them as `self.facts`;
the width slicing (fedlase/slicing.py) and the `kept` coverage rule's owners read them from there. The trace is
lazy: it runs when a width method first asks for the groups, so a method that does not slice never traces."""
from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from .model_hooks import hook
from .slicing import width_slices

__all__ = ["ModelFacts", "frozen_fingerprint"]


@dataclass(frozen=True, eq=False)
class ModelFacts:
    """The facts of one model. `example`: two training samples to trace it with, kept only for a model that
    declares no channel groups (None: built outside a run, so a trace has nothing to run on)."""
    model: nn.Module
    example: torch.Tensor | None = None
    _traced: dict = field(default_factory=dict, init=False, repr=False)   # "groups", "sliceable", once traced

    @classmethod
    def of(cls, model: nn.Module, data) -> ModelFacts:
        """The facts of a model built for a run on `data` (a fedlase Dataset): a copy of two of its training
        samples for a model that declares no channel groups (never a view of the whole dataset)."""
        x = getattr(data, "x_train", None)
        keep = isinstance(x, torch.Tensor) and len(x) and x.device.type != "meta" and not declares_groups(model)
        return cls(model, x[:2].detach().clone() if keep else None)

    def channel_groups(self, method: str = "width slices") -> dict[str, tuple]:
        """Parameter name -> (group of dim 0, group of dim 1): the model's `channel_groups()`, or derived by
        tracing it (once), or the one-line ConfigError of `method` (its name, for the message) cutting the
        channels of a model that cannot be traced."""
        declared = hook(self.model, "channel_groups")
        return declared() if declared is not None else dict(self._trace(method)[0])

    def sliceable(self, method: str = "width slices") -> bool:
        """Whether a width slice trains as the physically smaller tensors: the model's own `sliceable`, else the
        trace's trial; a model that declares its groups but not `sliceable` trains masked."""
        declared = hook(self.model, "sliceable")
        if declared is not None:
            return bool(declared)
        return hook(self.model, "channel_groups") is None and self._trace(method)[1]

    def group_units(self) -> dict[str, int]:
        """Group -> channels per unit, for groups cut in whole units (the model's `group_units()`; else none)."""
        declared = hook(self.model, "group_units")
        return declared() if declared is not None else {}

    def known_groups(self) -> dict[str, tuple] | None:
        """The channel groups where the model declares them or a width method has traced them; None otherwise
        (asking never traces: the `kept` coverage rule names no BN owner of a model nothing sliced)."""
        declared = hook(self.model, "channel_groups")
        if declared is not None:
            return declared()
        return dict(self._traced["groups"]) if self._traced else None

    def traced(self) -> bool:
        """Whether the channel groups were derived by tracing (the model declares none and a width method asked)."""
        return bool(self._traced)

    def check_kept(self, keep: dict[str, torch.Tensor], method: str | None = None) -> None:
        """A traced model checked with the channels `keep` kept (group -> bool vector), the first time a set is
        used: the one-line ConfigError of fedlase/models/trace.py's `check_kept` (naming `method`, default the
        one that traced it) if it moves channels there. A model that declares its groups is taken at its word."""
        if self._traced:
            from .models.trace import check_kept
            check_kept(self.model, self._traced["groups"], self._traced["sliceable"], self.example,
                       method or self._traced["method"], width_slices, keep)

    def _trace(self, method: str) -> tuple[dict, bool]:
        if not self._traced:
            from .models.trace import derive_groups  # Torch-Pruning is imported only for such a model
            groups, sliceable = derive_groups(self.model, self.example, method, width_slices)
            self._traced.update(groups=groups, sliceable=sliceable, method=method)
        return self._traced["groups"], self._traced["sliceable"]


def declares_groups(model) -> bool:
    return hook(model, "channel_groups") is not None or hook(model, "group_units") is not None


# the frozen bases hashed in this process: their state (`_frozen_state`) -> their fingerprint
_FINGERPRINTS: dict[tuple, dict] = {}


def _frozen_state(frozen: list) -> tuple:
    """What identifies the frozen tensors' values without reading them: each one's name, its storage (a weak
    reference: alive while that storage is, so a freed base's address taken by a new one is a different state),
    its place in it, and its version (torch counts every in-place write through the tensor; not writes through
    `.data`, which fedlase never makes to a base: FLoRA's merge gives its base weights new storages)."""
    return tuple((n, weakref.ref(p.untyped_storage()), p.storage_offset(), tuple(p.shape), p.stride(), p.dtype,
                  p._version) for n, p in frozen)


def frozen_fingerprint(model: nn.Module) -> dict | None:
    """{"frozen": parameter count, "sha256": hash of the frozen parameters' names and bytes in order} of a model
    with frozen parameters (a LoRA run's base), which a checkpoint names instead of holding them; None for a model
    that trains every parameter. Hashed once per process per base (half a gigabyte for SmolLM2's): the same
    tensors, unchanged, give the kept fingerprint, whichever model object holds them."""
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    if not frozen:
        return None
    state = _frozen_state(frozen)
    if state not in _FINGERPRINTS:
        for old in [k for k in _FINGERPRINTS if any(ref() is None for _, ref, *_ in k)]:   # bases since freed
            del _FINGERPRINTS[old]
        _FINGERPRINTS[state] = _hash_frozen(frozen)
    return dict(_FINGERPRINTS[state])


def _hash_frozen(frozen: list) -> dict:
    h = hashlib.sha256()
    for n, p in frozen:
        h.update(n.encode())
        t = p.detach().cpu().contiguous()
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return {"frozen": sum(p.numel() for _, p in frozen), "sha256": h.hexdigest()}

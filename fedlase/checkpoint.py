"""A run folder's checkpoint.pt, written and read as plain data: the one place that saves or loads one.

A run folder is data, not code: people share them to compare or evaluate again, and loading one must never run
anything it holds. So a checkpoint is read with torch's weights-only loader, which builds tensors and plain
Python values (dict, list, tuple, str, int, float, bool, None) and refuses any other object. What a run
stores beside its tensors is turned into those values on saving and back on loading: a numpy array (the
analyses' histories) becomes {"__numpy__": dtype, "shape": ..., "data": its bytes as a uint8 tensor}, bit
for bit. A file that the weights-only loader refuses, or that is not laid out as below, is refused in one line
naming it.

Layout: {"format": FORMAT, "round": int, "train_time": float, "params": {name: tensor}, "buffers": {name:
tensor}, "method": dict, "trackers": [dict, ...], "runner": dict, "config": dict}, and, for a model with frozen
parameters (a LoRA run's base), "frozen": {"frozen": count, "sha256": hash} naming them: "params" holds the
trainable tensors only, never the base. Checkpoints written before
the format key existed load too where the weights-only loader admits them (those of runs without analyses);
those holding numpy arrays are refused with the command that rewrites them (`fedlase convert-checkpoint`, for
files one trusts)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from .errors import UserError
from .util import atomic_write

__all__ = ["FORMAT", "save", "load", "convert", "to_plain", "from_plain"]

FORMAT = "fedlase-checkpoint/1"
_NUMPY = "__numpy__"
_LAYOUT = {"round": int, "train_time": (int, float), "params": dict, "buffers": dict, "method": dict,
           "trackers": list, "runner": dict, "config": dict}
_PLAIN = (str, int, float, bool, type(None))
_CONVERT = "fedlase convert-checkpoint"


def to_plain(obj, where: str = "checkpoint"):
    """`obj` with every numpy array and scalar turned into a tagged dict of plain values; UserError naming
    `where` for anything the weights-only loader would not read back (a plugin's method state, for one)."""
    if isinstance(obj, (np.ndarray, np.generic)):   # first: numpy's float64 is a float, yet pickles as numpy
        a = np.asarray(obj)
        if a.dtype.hasobject or a.dtype.fields is not None:   # dtype.str would not say what the fields are
            raise UserError(f"{where}: a numpy array of {a.dtype} cannot be checkpointed; store numbers")
        raw = np.frombuffer(np.ascontiguousarray(a).tobytes(), dtype=np.uint8).copy()
        return {_NUMPY: a.dtype.str, "shape": list(a.shape) if isinstance(obj, np.ndarray) else None,
                "data": torch.from_numpy(raw)}   # a uint8 tensor: every torch's weights-only loader reads one
    if type(obj) in _PLAIN or isinstance(obj, torch.Tensor):   # exact types: a subclass pickles by its name
        return obj
    if isinstance(obj, dict):
        for k in obj:
            if not _plain_key(k):
                raise UserError(f"{where}: a key of type {type(k).__name__} cannot be checkpointed; use str or int")
        return {k: to_plain(v, f"{where}.{k}") for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(to_plain(v, f"{where}[{i}]") for i, v in enumerate(obj))
    raise UserError(f"{where}: a {type(obj).__name__} cannot be checkpointed; a checkpoint holds tensors, "
                    "numpy arrays of numbers, numbers, strings, None, lists, tuples and dicts")


def _plain_key(k) -> bool:
    return type(k) in _PLAIN or (type(k) is tuple and all(map(_plain_key, k)))


def from_plain(obj):
    """The inverse of to_plain: tagged dicts back into numpy arrays (scalars where `shape` is None)."""
    if isinstance(obj, dict):
        if set(obj) == {_NUMPY, "shape", "data"}:
            dtype = np.dtype(str(obj[_NUMPY]))
            if dtype.hasobject:
                raise ValueError("a numpy array of Python objects")
            data = obj["data"]
            if not (isinstance(data, torch.Tensor) and data.dtype == torch.uint8 and data.dim() == 1):
                raise ValueError("its data is not a uint8 tensor")
            a = np.frombuffer(data.numpy().tobytes(), dtype=dtype).copy()   # copy: writable, the file's no more
            return a[0] if obj["shape"] is None else a.reshape(obj["shape"])
        return {k: from_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_plain(v) for v in obj)
    return obj


def save(state: dict, path) -> None:
    """Write `state` (Experiment.state_dict()) to `path` in the plain layout, atomically."""
    plain = {"format": FORMAT, **to_plain(state)}
    atomic_write(Path(path), lambda tmp: torch.save(plain, tmp))


def load(path) -> dict:
    """The state saved in `path`, read weights-only (nothing in the file runs); UserError in one line naming the
    file when it is not a checkpoint of this layout."""
    path = Path(path)
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{path}: no such checkpoint") from None
    except Exception as e:   # noqa: BLE001 -- whatever the file made torch raise: it is not a plain checkpoint
        # the name torch refused (older torch words it "Unsupported class")
        found = re.search(r"GLOBAL ([\w.]+)", str(e)) or re.search(r"Unsupported class ([\w.]+)", str(e))
        if found is None:   # not a torch file at all, or a torn one
            raise UserError(f"{path}: not a readable checkpoint ({type(e).__name__}); nothing in it was run") \
                from None
        name = found.group(1)
        # numpy arrays are what an older fedlase stored beside the tensors (the analyses' histories)
        hint = (f"; if an older fedlase wrote it and you trust the file, `{_CONVERT} {path}` rewrites it as plain "
                "data" if name.startswith("numpy") else "")
        raise UserError(f"{path}: refused: it holds {name}, which is not plain data; nothing in it was run{hint}") \
            from None
    problem = _layout_problem(raw)
    if problem:
        raise UserError(f"{path}: not a fedlase checkpoint ({problem})")
    try:
        state = from_plain({k: v for k, v in raw.items() if k != "format"})
    except (ValueError, TypeError) as e:
        raise UserError(f"{path}: not a fedlase checkpoint (a stored array: {e})") from None
    return state


def _layout_problem(raw) -> str | None:
    if not isinstance(raw, dict):
        return f"it holds a {type(raw).__name__}"
    if raw.get("format", FORMAT) != FORMAT:
        return f"format {raw['format']!r}; this fedlase reads {FORMAT!r}"
    for key, kind in _LAYOUT.items():
        if not isinstance(raw.get(key), kind):
            return f"no {key}" if key not in raw else f"{key} is a {type(raw[key]).__name__}"
    for key in ("params", "buffers"):
        if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in raw[key].items()):
            return f"{key} holds more than named tensors"
    return None


def convert(path) -> None:
    """Rewrite a checkpoint of an older fedlase in the plain layout. It is loaded with torch's full unpickler,
    which runs whatever the file holds: only for files one trusts (`fedlase convert-checkpoint`)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such checkpoint")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:   # noqa: BLE001 -- not a torch file at all
        raise UserError(f"{path}: not a readable checkpoint ({type(e).__name__})") from None
    problem = _layout_problem(state)
    if problem:
        raise UserError(f"{path}: not a fedlase checkpoint ({problem})")
    save({k: v for k, v in state.items() if k != "format"}, path)


def check_plugins(path, names, hint: str) -> None:
    """A config read from a run folder (a checkpoint's, a summary.json's) may name `plugins`; importing a module
    runs its code, so fedlase imports none that a run folder names. Each must be imported already (an installed
    entry point, or the user's own `plugins=[...]`); UserError naming `path` otherwise, with `hint`."""
    import sys
    listed = names if isinstance(names, (list, tuple)) else [names]
    missing = [str(n) for n in listed if str(n) not in sys.modules]
    if missing:
        raise UserError(f"{path}: the run names plugins {', '.join(missing)}, which fedlase does not import from "
                        f"a run folder; {hint}")

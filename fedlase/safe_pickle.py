"""Reading a pickle that comes from outside (a dataset's files, such as CIFAR's python batches) as plain data.

`pickle.load` calls whatever importable function a file names, so a tampered file runs code when loaded.
PlainUnpickler resolves no name but the few that rebuild numpy arrays of numbers; everything else a pickle
can hold without naming a function (dict, list, tuple, str, bytes, int, float, bool, None) loads as usual.
A file naming anything more is refused before any of it is used. fedlase's own checkpoints are not pickles
of this kind: fedlase/checkpoint.py reads them with torch's weights-only loader."""
from __future__ import annotations

import codecs
import importlib
import pickle
from pathlib import Path

import numpy as np

from .errors import DataError

__all__ = ["PlainUnpickler", "load_plain_pickle"]


def _dtype(*args):
    """numpy.dtype, without object fields (an object array would hold whatever the pickle builds into it)."""
    d = np.dtype(*args)
    if d.hasobject:
        raise pickle.UnpicklingError("refusing a numpy array of Python objects")
    return d


def _latin1(text, encoding="latin1", errors="strict"):
    """_codecs.encode as Python 3 uses it to pickle bytes at protocol 2 (always latin1); no other codec."""
    if encoding not in ("latin1", "latin-1") or errors != "strict":
        raise pickle.UnpicklingError(f"refusing the {encoding!r} codec")
    return codecs.encode(text, "latin1")


def _numpy_core(name: str):
    """A function of numpy's core, under numpy 2's module name (numpy._core) or numpy 1's (numpy.core): files
    pickled by numpy 1 name numpy.core, which numpy 2 still resolves but with a deprecation warning."""
    module, attr = name.rsplit(".", 1)
    for prefix in ("numpy._core", "numpy.core"):
        try:
            return getattr(importlib.import_module(f"{prefix}.{module}"), attr)
        except (ImportError, AttributeError):
            continue
    raise pickle.UnpicklingError(f"numpy has no {name}")


# (module, name) in the file -> what it is resolved to; the exact globals numpy arrays and scalars pickle to
_NUMPY = {"multiarray._reconstruct", "multiarray.scalar", "numeric._frombuffer"}
_ALLOWED = {("numpy", "ndarray"): lambda: np.ndarray, ("numpy", "dtype"): lambda: _dtype,
            ("_codecs", "encode"): lambda: _latin1,
            **{(f"{core}.{name.rsplit('.', 1)[0]}", name.rsplit(".", 1)[1]): (lambda n=name: _numpy_core(n))
               for core in ("numpy.core", "numpy._core") for name in _NUMPY}}


class PlainUnpickler(pickle.Unpickler):
    """An Unpickler that admits plain Python data and numpy arrays of numbers, and refuses every other global
    (pickle.UnpicklingError naming it) instead of importing and calling it."""

    def find_class(self, module: str, name: str):
        make = _ALLOWED.get((module, name))
        if make is None:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return make()


def load_plain_pickle(path: Path, what: str, encoding: str = "bytes"):
    """The plain data pickled in `path`; DataError (one line naming the file and `what` was expected) when it
    is missing, unreadable, or names anything but numpy arrays. `encoding="bytes"` reads Python 2's strings
    (CIFAR's batches) as bytes."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file missing (expected {what})")
    try:
        with open(path, "rb") as f:
            return PlainUnpickler(f, encoding=encoding).load()
    except Exception as e:   # noqa: BLE001 -- whatever the file made the unpickler raise, it is not `what`
        raise DataError(f"{path}: not {what}: {type(e).__name__}: {' '.join(str(e).split())[:200]}") from None

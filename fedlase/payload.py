"""What a client's payload holds, and its size in bytes, in torch and numpy alone: the Flower codec
(fedlase/flower/codec.py) wraps these arrays into Flower's records, and the simulated clock (fedlase/cost.py)
counts their bytes, so a run's simulated time is the same whether or not the `flower` extra is installed.

Down (server -> client), per parameter:
  - masked: the values on the submodel's support, in row-major order, plus the support as packed bits
    (1 bit a coordinate; no bits when all are kept). For a threshold submodel the support is mask | (|w| >= tau),
    so the client's |w| >= tau re-evaluation sees exactly the weights it would see with the whole model; everything else
    is rebuilt as 0, which the masked forward multiplies by 0 anyway. The credited mask travels as a
    second bit array only where it differs from the support (never for FIARSE, whose mask is |w| >= tau).
  - not masked: the dense tensor.
  A width slice's kept indices per dim; the model's buffers and the submodel's buffer overrides, dense.
  A method's own local objective (`Submodel.local`: FjORD's widths, DepthFL's exits, FedDSE's channel scoring) is
  code, not arrays, and is not sent: the node rebuilds it with its own copy of the method from the level and the
  round (fedlase/flower/client_app.py, `with_objective`), as the server built it.
Up (client -> server): the delta's values on the credited mask only (dense for unmasked parameters), and the
  tensors of the method's own beside it, as they are (`Method.own_reply`: FedDSE's channel choice).

Each array travels as an .npy file (numpy's header, then the raw values): `npy_bytes` is its size."""
from __future__ import annotations

import functools
import io
import math

import numpy as np
import torch

from .masks import Submodel

Array = torch.Tensor | np.ndarray


def pack_bits(mask: torch.Tensor) -> np.ndarray:
    return np.packbits(mask.detach().cpu().numpy().astype(bool).ravel())


def unpack_bits(bits: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    n = math.prod(shape)
    return torch.from_numpy(np.unpackbits(bits, count=n).astype(bool).reshape(shape))


def support(sub: Submodel, name: str, w: torch.Tensor) -> torch.Tensor:
    """The coordinates whose values the client needs: its mask, plus, under a threshold, |w| >= tau."""
    m = sub.masks[name]
    if sub.thresholds is not None and name in sub.thresholds:
        m = m | (w.abs() >= sub.thresholds[name])
    return m


def submodel_arrays(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                    sub: Submodel) -> dict[str, dict[str, Array]]:
    """The arrays a submodel travels as, by group ("values", "bits", "credit", "slices", "buffers",
    "sub-buffers"); its local objective, if any, is not among them (the node rebuilds it)."""
    values, bits, credit = {}, {}, {}
    for n, w in params.items():
        if n in sub.masks:
            s = support(sub, n, w)
            values[n] = w[s]
            bits[n] = pack_bits(s) if not bool(s.all()) else np.zeros(0, np.uint8)   # empty: all kept
            if not torch.equal(s, sub.masks[n]):
                credit[n] = pack_bits(sub.masks[n])
        else:
            values[n] = w
    # A width slice travels as its kept indices per dim ("name|d"), so the node trains the smaller model too.
    slices = {f"{n}|{d}": i.to(torch.int64) for n, index in sub.slices.items()
              for d, i in enumerate(index) if i is not None}
    return {"values": values, "bits": bits, "credit": credit, "slices": slices, "buffers": dict(buffers),
            "sub-buffers": dict(sub.buffers)}


def delta_arrays(delta: dict[str, torch.Tensor], sub: Submodel) -> dict[str, torch.Tensor]:
    """The arrays a client's reply travels as: each delta on its credited mask (whole where unmasked)."""
    return {n: d[sub.masks[n]] if n in sub.masks else d for n, d in delta.items()}


@functools.lru_cache(maxsize=4096)
def _header_bytes(descr: str, shape: tuple[int, ...]) -> int:
    """The .npy header's size for an array of this dtype and shape, as np.save writes it (version 1.0, or 2.0
    when the header does not fit)."""
    buf, header = io.BytesIO(), {"descr": descr, "fortran_order": False, "shape": shape}
    try:
        np.lib.format.write_array_header_1_0(buf, header)
    except ValueError:
        buf = io.BytesIO()
        np.lib.format.write_array_header_2_0(buf, header)
    return len(buf.getvalue())


def npy_bytes(a: Array) -> int:
    """Bytes of one array as it travels: its .npy header and its values."""
    dtype = np.dtype(str(a.dtype).removeprefix("torch.")) if isinstance(a, torch.Tensor) else a.dtype
    shape = tuple(int(d) for d in a.shape)
    return _header_bytes(np.lib.format.dtype_to_descr(dtype), shape) + math.prod(shape) * dtype.itemsize


def payload_bytes(arrays: dict[str, Array] | dict[str, dict[str, Array]]) -> int:
    """Bytes of a payload's arrays as they travel (.npy headers included; names and framing excluded); `arrays`:
    one group (name -> array) or several (group -> name -> array)."""
    return sum(payload_bytes(a) if isinstance(a, dict) else npy_bytes(a) for a in arrays.values())

"""Wire format of submodels and replies, and the check every reply passes before it is aggregated.

What travels each way, as plain arrays, is fedlase/payload.py's (`submodel_arrays`, `delta_arrays`: the same
arrays whose bytes the simulated clock counts); here they become Flower's records: the submodel's thresholds,
scales and slice layout go in a ConfigRecord beside them, with whether it trains with its method's own local
objective, which the node rebuilds (fedlase/flower/client_app.py, `with_objective`).

Nothing here knows Flower's transport beyond `Array`/`ArrayRecord`/`ConfigRecord`."""
from __future__ import annotations

import math

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from ..masks import Submodel
from ..payload import delta_arrays, submodel_arrays, unpack_bits

NPY_HEADER_SLACK = 256   # bytes an .npy header may add to an array's raw data (np.save writes 128 for ours)


class ReplyError(ValueError):
    """A client's reply that must not be aggregated; the message says why."""


def _arr(t: torch.Tensor | np.ndarray) -> Array:
    return Array(t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else t)


def record_bytes(*records: ArrayRecord) -> int:
    """Array payload bytes as they travel (.npy headers included; keys and protobuf framing excluded)."""
    return sum(len(a.data) for r in records for a in r.values())


# ---- down: the submodel ----------------------------------------------------------------------------------------
def encode_submodel(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], sub: Submodel) -> RecordDict:
    arrays = submodel_arrays(params, buffers, sub)
    names = sorted(sub.thresholds or {})
    scaled = sorted(sub.scales)
    cfg = ConfigRecord({"ste": sub.ste, "threshold-names": names,
                        "threshold-values": [float(sub.thresholds[n]) for n in names],
                        "has-thresholds": sub.thresholds is not None,
                        "scale-names": scaled, "scale-values": [float(sub.scales[n]) for n in scaled],
                        "slice-names": sorted(sub.slices),
                        "slice-dims": [len(sub.slices[n]) for n in sorted(sub.slices)],
                        "local": sub.local is not None})
    return RecordDict({**{group: ArrayRecord({n: _arr(a) for n, a in named.items()})
                          for group, named in arrays.items()}, "submodel": cfg})


def decode_submodel(content: RecordDict, template: dict[str, torch.Tensor]):
    """-> (params, buffers, Submodel), with params rebuilt as zeros off the support. `template` gives the
    names, shapes and dtypes of the client's own model. The Submodel comes without its local objective: whether
    it has one is the ConfigRecord's `local` (`has_objective`)."""
    records = content.array_records
    values, bits, credit = records["values"], records["bits"], records["credit"]
    params, masks = {}, {}
    for n, t in template.items():
        v = torch.from_numpy(values[n].numpy())
        if n in bits:
            b = bits[n].numpy()
            s = unpack_bits(b, tuple(t.shape)) if b.size else torch.ones(t.shape, dtype=torch.bool)
            if v.shape != (int(s.sum()),):   # `w[s] = v` would broadcast one value, or a (1, n) array, over the mask
                raise ValueError(f"{n}: {list(v.shape)} values for a mask of {int(s.sum())}")
            w = torch.zeros(t.shape, dtype=v.dtype)
            w[s] = v
            params[n] = w
            masks[n] = unpack_bits(credit[n].numpy(), tuple(t.shape)) if n in credit else s
        else:
            params[n] = v
    cfg = content.config_records["submodel"]
    thresholds = dict(zip(cfg["threshold-names"], cfg["threshold-values"])) if cfg["has-thresholds"] else None
    buffers = {n: torch.from_numpy(a.numpy()) for n, a in content.array_records["buffers"].items()}
    sub_buffers = {n: torch.from_numpy(a.numpy()) for n, a in content.array_records["sub-buffers"].items()}
    scales = dict(zip(cfg["scale-names"], cfg["scale-values"]))
    arrays = content.array_records["slices"]
    slices = {n: tuple(torch.from_numpy(arrays[f"{n}|{d}"].numpy()) if f"{n}|{d}" in arrays else None
                       for d in range(k)) for n, k in zip(cfg["slice-names"], cfg["slice-dims"])}
    return params, buffers, Submodel(masks, thresholds, str(cfg["ste"]), sub_buffers, slices, scales)


def has_objective(content: RecordDict) -> bool:
    """Whether the submodel a message carries trains with its method's own local objective (not sent)."""
    return bool(content.config_records["submodel"].get("local", False))


# ---- up: the reply ---------------------------------------------------------------------------------------------
def encode_delta(delta: dict[str, torch.Tensor], sub: Submodel) -> ArrayRecord:
    return ArrayRecord({n: _arr(d) for n, d in delta_arrays(delta, sub).items()})


def expected_reply(params: dict[str, torch.Tensor], sub: Submodel) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of each array a valid reply holds."""
    return {n: (((int(sub.masks[n].sum()),) if n in sub.masks else tuple(p.shape)), p.dtype) for n, p in params.items()}


def validate_reply(arrays: ArrayRecord, params: dict[str, torch.Tensor], sub: Submodel,
                   own: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None) -> dict[str, torch.Tensor]:
    """The dense delta of a reply, with the method's own tensors it must hold beside it (`own`: name -> (shape,
    dtype), `Method.own_reply`: FedDSE's channel choice), or ReplyError saying why it must be rejected.

    Checked before anything is decoded: the names, each array's declared dtype and shape (at most the
    parameter's own, so nothing larger than the model is ever read) and its raw size; then the decoded
    array against its declaration, NaN/Inf, and, for a dense delta sent for a masked parameter, values off
    the client's mask (rejected either way: it is larger than the submodel allows)."""
    want = {**expected_reply(params, sub), **(own or {})}
    device = next(iter(params.values())).device
    extra, missing = sorted(set(arrays) - set(want)), sorted(set(want) - set(arrays))
    if extra:
        raise ReplyError(f"unknown parameter(s) {', '.join(extra[:3])}")
    if missing:
        raise ReplyError(f"missing parameter(s) {', '.join(missing[:3])}")
    delta = {}
    for n, (shape, dt) in want.items():
        a = arrays[n]
        ashape, dtype = tuple(a.shape), str(dt).removeprefix("torch.")
        dense = n in sub.masks and n in params and ashape == tuple(params[n].shape) and ashape != shape  # whole
        if a.dtype != dtype:
            raise ReplyError(f"{n}: dtype {a.dtype}, expected {dtype}")
        if ashape != shape and not dense:
            raise ReplyError(f"{n}: shape {ashape}, expected {shape}")
        if len(a.data) > math.prod(ashape) * dt.itemsize + NPY_HEADER_SLACK:
            raise ReplyError(f"{n}: payload of {len(a.data)} bytes is larger than {math.prod(ashape)} values allow")
        try:
            v = a.numpy()
        except (ValueError, TypeError, OSError) as e:
            raise ReplyError(f"{n}: unreadable array ({e})") from None
        if v.shape != ashape or str(v.dtype) != dtype:
            raise ReplyError(f"{n}: holds {v.dtype}{list(v.shape)} but declares {a.dtype}{list(ashape)}")
        v = torch.from_numpy(v.copy())
        if not bool(torch.isfinite(v).all()):
            raise ReplyError(f"{n}: NaN or Inf in the delta")
        m = sub.masks.get(n) if n in params else None
        if dense:
            off = int((v[~m.cpu()] != 0).sum())
            if off:
                raise ReplyError(f"{n}: {off} value(s) outside the client's mask")
            raise ReplyError(f"{n}: payload of {v.numel()} values is larger than the {shape[0]} its mask allows")
        if m is not None:
            d = torch.zeros(params[n].shape, dtype=dt)
            d[m.cpu()] = v
            v = d
        delta[n] = v.to(device)
    return delta

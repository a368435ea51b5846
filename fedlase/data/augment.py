"""Training-time augmentation of image batches (the random crop and flip of the CIFAR papers). Its own module so
that local training needs no dataset loader."""
from __future__ import annotations

import torch


def augment_batch(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random crop with 4-pixel zero padding plus random horizontal flip, per sample.

    x is (B, C, H, W). The padding value is 0 in the tensor's (normalised) units, i.e. the
    train-set channel mean. All random numbers come from `generator` (drawn on its device),
    so equal generator states give equal outputs. Vectorised: one gather for the batch.
    """
    b, _, h, w = x.shape
    pad = 4
    dev = generator.device
    # non_blocking: a CPU generator's draws reach a GPU batch without a host sync each step (pageable memory is
    # staged at once, so this is safe); on a CPU it changes nothing
    oy = torch.randint(0, 2 * pad + 1, (b,), generator=generator, device=dev).to(x.device, non_blocking=True)
    ox = torch.randint(0, 2 * pad + 1, (b,), generator=generator, device=dev).to(x.device, non_blocking=True)
    flip = (torch.rand((b,), generator=generator, device=dev) < 0.5).to(x.device, non_blocking=True)
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    ar_h = torch.arange(h, device=x.device)
    ar_w = torch.arange(w, device=x.device)
    rows = oy[:, None] + ar_h  # (B, H)
    # A flipped crop reads its columns right to left.
    cols = ox[:, None] + torch.where(flip[:, None], (w - 1) - ar_w, ar_w)  # (B, W)
    bi = torch.arange(b, device=x.device)[:, None, None]
    # Advanced indices around a slice put the indexed dims first: result is (B, H, W, C).
    out = padded[bi, :, rows[:, :, None], cols[:, None, :]]
    return out.permute(0, 3, 1, 2).contiguous()

"""What a level's submodel of MiniLM still knows (docs/text.md).

For each level: mean-pool the submodel's last hidden states over 600 BBC News training articles and the 444 test
articles, and fit a linear probe (ridge regression on standardised features, one column per class). A probe near
90% means the submodel still separates the classes and what is left is teaching the head; near 20% would mean the
extraction destroyed them. With a trained run, also how much the run's own head's logits vary across texts.

    python scripts/text_linear_probe.py pretrained [budget|whole] [max_length]   # FedLASE and FIARSE masks
    python scripts/text_linear_probe.py RUN_DIR                                  # a run's checkpoint
"""
from __future__ import annotations

import sys
import types

import torch
from torch.func import functional_call

from fedlase.data import text as textdata
from fedlase.methods.fedlase import FedLASE
from fedlase.methods.fiarse import FIARSE
from fedlase.models.transformer import build_minilm

LEVELS = [1.0, 1 / 4, 1 / 16, 1 / 64]


def pooled(model, weights: dict, x: torch.Tensor) -> torch.Tensor:
    inner = {k[len("backbone."):]: v for k, v in weights.items() if k.startswith("backbone.")}
    out = []
    with torch.no_grad():
        for i in range(0, len(x), 100):
            xb = x[i:i + 100]
            keep = (xb != model.pad_id)
            h = functional_call(model.backbone, inner, args=(), kwargs={"input_ids": xb,
                                                                         "attention_mask": keep.long()})
            w = keep.unsqueeze(-1).float()
            out.append((h.last_hidden_state * w).sum(1) / w.sum(1))
    return torch.cat(out)


def linear_probe(f_train, y_train, f_test, y_test, classes: int, ridge: float = 10.0) -> float:
    mu, sd = f_train.mean(0), f_train.std(0) + 1e-6
    a, b = (f_train - mu) / sd, (f_test - mu) / sd
    target = torch.nn.functional.one_hot(y_train, classes).float()
    w = torch.linalg.solve(a.T @ a + ridge * torch.eye(a.shape[1]), a.T @ target)
    return float(((b @ w).argmax(1) == y_test).float().mean())


def trained(run_dir: str) -> None:
    from fedlase import checkpoint
    from fedlase.catalog import load_builtins
    from fedlase.config import config_from_dict
    from fedlase.engine import Experiment
    load_builtins()
    state = checkpoint.load(f"{run_dir}/checkpoint.pt")   # weights-only
    exp = Experiment.from_config(config_from_dict(state["config"]))
    exp.load_state_dict(state)
    model, params = exp.model.eval(), exp.state.params
    pick = torch.randperm(len(exp.y_train), generator=torch.Generator().manual_seed(0))[:600]
    print(f"{run_dir}, round {exp.round}")
    print("| level | linear probe | feature spread / offset | std of the head's logits over texts | "
          "test texts per predicted class |\n|---|---|---|---|---|")
    for level in exp.levels:
        weights = exp.method.eval_submodel(params, level, exp.round).apply(params)
        f_train, f_test = pooled(model, weights, exp.x_train[pick]), pooled(model, weights, exp.x_test)
        acc = linear_probe(f_train, exp.y_train[pick], f_test, exp.y_test, int(exp.y_test.max()) + 1)
        logits = f_test @ params["classifier.weight"].T + params["classifier.bias"]   # the run's head
        counts = torch.bincount(logits.argmax(1), minlength=logits.shape[1]).tolist()
        print(f"| {level.name} | {100 * acc:.1f}% | {float(f_train.std(0).mean() / f_train.mean(0).abs().mean()):.2f} "
              f"| {float(logits.std(0).mean()):.3f} | {counts} |", flush=True)


def main(word_embeddings: str = "budget", max_length: int = 64) -> None:
    torch.set_num_threads(1)
    cfg = types.SimpleNamespace(model="minilm", max_length=max_length, seed=0, word_embeddings=word_embeddings)
    ds = textdata.load_bbc_news(cfg)
    model = build_minilm(cfg, ds).eval()
    params = {n: p.detach() for n, p in model.named_parameters()}
    pick = torch.randperm(len(ds.y_train), generator=torch.Generator().manual_seed(0))[:600]
    print(f"word_embeddings={word_embeddings}, max_length={max_length}")
    print("| method | level | linear probe | feature spread / offset |\n|---|---|---|---|")
    for name, method in (("fedlase", FedLASE(model, LEVELS)), ("fiarse", FIARSE(model, LEVELS))):
        for level in LEVELS:
            weights = method.submodel(params, level, 1).apply(params)
            f_train, f_test = pooled(model, weights, ds.x_train[pick]), pooled(model, weights, ds.x_test)
            acc = linear_probe(f_train, ds.y_train[pick], f_test, ds.y_test, ds.num_classes)
            # how much the features vary across texts against their common offset
            spread = float(f_train.std(0).mean() / f_train.mean(0).abs().mean())
            print(f"| {name} | {level:g} | {100 * acc:.1f}% | {spread:.2f} |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] != "pretrained":
        trained(sys.argv[1])
    else:
        main(sys.argv[2] if len(sys.argv) > 2 else "budget", int(sys.argv[3]) if len(sys.argv) > 3 else 64)

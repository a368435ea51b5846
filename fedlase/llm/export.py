"""`fedlase export RUN out=DIR`: a LoRA run's trained adapter as a peft folder (docs/llm.md, "Export").

The folder holds adapter_config.json and adapter_model.safetensors, which `peft.PeftModel.from_pretrained` loads on
the run's Hugging Face transformer (the base the checkpoint names: MiniLM's BertModel, a decoder's causal LM), and,
where the run trained a head outside the transformer (a classifier), head.safetensors with its tensors named as in
fedlase's model. A level's adapter is the slice its clients train (`level=1/4`: its rank; default the largest
level's). FLoRA merges its adapters into the base every round, so what it exports is the merged update itself, as
an adapter of full rank per target (its SVD, exact up to float rounding), alpha set so that peft's scale is 1."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import UserError

__all__ = ["export_run"]


def export_run(run_dir, out, level: str | None = None) -> Path:
    """Write the adapter of run folder `run_dir` (a LoRA run's checkpoint) at `level` (a level's name; None: the
    largest) into the folder `out`; returns it. One-line UserErrors for a run without adapters, an unknown level,
    or an `out` that already holds an adapter."""
    from safetensors.torch import save_file

    from ..checkpoint import load
    from ..config import config_from_dict
    from ..engine import Experiment
    from .adapters import _peft, transformer_of
    run_dir, out = Path(run_dir), Path(out)
    ckpt = run_dir / "checkpoint.pt"
    if not ckpt.is_file():
        raise UserError(f"{run_dir}: no checkpoint.pt to export")
    state = load(ckpt)
    raw = dict(state["config"], out=str(run_dir))
    if not raw.get("lora"):
        raise UserError(f"{run_dir}: the run trained no LoRA adapters (no lora key); export writes a peft adapter")
    if (out / "adapter_model.safetensors").exists():
        raise UserError(f"out: {out} already holds an adapter; choose another folder")
    exp = Experiment.from_config(config_from_dict(raw))
    exp.load_state_dict(state)
    lvl = exp.levels[0] if level is None else exp.cfg.levels.find(level)
    if lvl is None:
        raise UserError(f"level: {level!r} is not a level of the run ({', '.join(v.name for v in exp.levels)})")
    model, method = exp.model, exp.method
    path, hf = transformer_of(model.model)
    inner = f"model.{path}." if path else "model."
    weights = method.eval_submodel(exp.params, lvl, exp.round).model(exp.params, exp.buffers, sliced=True)[0]
    tensors, ranks, alphas = {}, {}, {}
    merged = method.state_dict().get("merged", {}) if method.name == "flora" else {}
    for ad in model.adapters:
        module = ad.path[len(inner):]
        if merged:   # FLoRA: the merged update as a full-rank adapter (B A = update, scale 1)
            update = merged.get(ad.base)
            if update is None:
                continue
            b, a = _full_rank(update)
        else:
            a, b = weights[ad.a], weights[ad.b]
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.detach().cpu().contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.detach().cpu().contiguous()
        ranks[module] = a.shape[0]
        alphas[module] = float(a.shape[0]) if merged else model.scaling * a.shape[0]
    if not tensors:
        raise UserError(f"{run_dir}: nothing to export yet (FLoRA has merged no round)")
    r = max(ranks.values())
    config = _peft().LoraConfig(r=r, lora_alpha=alphas[next(iter(alphas))], target_modules=sorted(ranks),
                                rank_pattern=ranks, alpha_pattern=alphas, lora_dropout=exp.cfg.lora["dropout"],
                                bias="none", fan_in_fan_out=getattr(hf.config, "model_type", "") == "gpt2",
                                base_model_name_or_path=_base_name(exp.cfg))
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file(tensors, str(out / "adapter_model.safetensors"))
    head = {n[len("model."):]: p.detach().cpu().contiguous() for n, p in exp.params.items()
            if not n.startswith(inner) and n.startswith("model.")}
    if head:
        save_file(head, str(out / "head.safetensors"))
    (out / "fedlase.json").write_text(json.dumps({"run": str(run_dir), "round": exp.round, "method": method.name,
                                                  "level": lvl.name, "frozen": exp.frozen}, indent=1) + "\n")
    return out


def _full_rank(update: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, A) with B A = `update` exactly up to rounding: its full SVD, the singular values split evenly."""
    u, s, vh = torch.linalg.svd(update, full_matrices=False)
    root = s.sqrt()
    return u * root, root[:, None] * vh


def _base_name(cfg) -> str:
    """What the base is called in adapter_config.json: the local folder of model_path, or the model's name."""
    return str(cfg.model_path) if cfg.model_path else cfg.model

"""What a config may say of LoRA adapters (the `lora` key), checked without building anything: its options, the
ranks per level, and what it combines with. The checks that need the model (a target it has, a rank its target's
dimensions allow) run where the adapters are put on it (fedlase/llm/adapters.py). Imports no torch, so validating
a config stays cheap (fedlase/config.py)."""
from __future__ import annotations

from .errors import ConfigError
from .levels import width_rate, window_size
from .options import Option, check_options
from .registry import METHODS, MODELS

LORA = {
    "r": Option(8, "the adapters' rank at level 1 (the largest level): each adapter is B (out x r) A (r x in)",
                kind=int, low=1),
    "alpha": Option(16.0, "the LoRA scale: a level's adapter adds (alpha / r) B A to its target's weight, the same "
                    "factor at every level (a rank-k level trains the first k components of the rank-r adapter)",
                    kind=float, low=0, low_open=True),
    "dropout": Option(0.0, "dropout on the adapters' input (peft's lora_dropout), in [0, 1)", kind=float, low=0,
                      high=1, high_open=True),
    "targets": Option(None, "the module names to adapt, e.g. [query, value] (a name matches a module whose dotted "
                      "path ends with it); unset: the model's attention and MLP projections", kind=list),
    "ranks": Option(None, "the adapter methods' rank of each level, largest level first, e.g. [8, 4, 2, 1]; "
                    "unset: ceil(sqrt(level) x r), the rank a width method (heterofl, fedrolex) cuts", kind=list),
}


def default_ranks(r: int, levels) -> list[int]:
    """Each level's rank when `lora.ranks` is unset: ceil(sqrt(level) r), at least 1 -- the window a width method
    (fedlase/slicing.py: rate sqrt(level)) keeps of a group of r channels, so the two families agree."""
    return [window_size(r, width_rate(float(lv))) for lv in levels]


def check_lora(cfg) -> dict:
    """The `lora` mapping checked against the run (one-line ConfigError naming the key), defaults filled and the
    ranks per level resolved; {}: no adapters (the whole model trains)."""
    method = METHODS.get(cfg.method)
    if not cfg.lora:
        if method.adapters:
            raise ConfigError("lora", f"method {cfg.method} aggregates LoRA adapters; set lora (e.g. lora.r=8)")
        return {}
    out = check_options("lora", LORA, cfg.lora, "lora")
    if MODELS.get(cfg.model).kind != "text":
        raise ConfigError("lora", f"model {cfg.model} is not a transformer fedlase can put adapters on; lora "
                          "needs a text model (minilm, hf, or a decoder)")
    targets = out["targets"]
    if targets is not None and (not targets or not all(isinstance(t, str) and t for t in targets)):
        raise ConfigError("lora.targets", f"expected a list of module names, e.g. [query, value], got {targets!r}")
    levels = cfg.levels.levels
    ranks = out["ranks"]
    if ranks is None:
        ranks = default_ranks(out["r"], levels)
    elif not method.adapters and list(ranks) != default_ranks(out["r"], levels):   # the filled default passes:
        # a validated config's dict (a sweep child's, a checkpoint's) is validated again
        raise ConfigError("lora.ranks", f"sets the adapter methods' ranks; {cfg.method} chooses what a level trains "
                          "its own way (a width method cuts ceil(sqrt(level) r) ranks): drop it")
    else:
        if len(ranks) != len(levels) or not all(isinstance(k, int) and not isinstance(k, bool) for k in ranks):
            raise ConfigError("lora.ranks", f"expected {len(levels)} integer ranks (one per level, largest first), "
                              f"got {ranks!r}")
        if ranks[0] != out["r"] or any(not 1 <= k <= out["r"] for k in ranks) or sorted(ranks, reverse=True) != ranks:
            raise ConfigError("lora.ranks", f"must start at lora.r={out['r']} and not grow from a level to a smaller "
                              f"one, each in 1..{out['r']}; got {ranks!r}")
    out["ranks"] = list(ranks)
    if method.adapters and "rule" not in method.server_stages and cfg.schedule != "sync":
        raise ConfigError("schedule", f"method {cfg.method} aggregates a synchronous round's adapters at once (its "
                          f"own server step); schedule={cfg.schedule} is not supported with it")
    return out

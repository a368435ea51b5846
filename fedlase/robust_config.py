"""What a config may say of the server's robust rule and of simulated attackers (`robust`, `robust_args`,
`attack`, `attack_args`): the names, the options and their checks. fedlase/robust.py does the work; this
half imports no torch, so validating a config stays cheap (fedlase/config.py)."""
from __future__ import annotations

from .errors import ConfigError
from .options import Option, check_options

RULES = ("none", "screen", "bounded", "clip", "adaptive_clip", "trimmed_mean", "median", "multikrum")
ATTACKS = ("none", "scale", "sign_flip", "gaussian", "nan")

_SCREEN = Option(100.0, "reject an update whose norm per coordinate held exceeds this multiple of the round's "
                 "median (every rule but none; default 3 under bounded, 100 under the others); non-finite updates "
                 "and losses are always rejected", low=1)
# bounded (the default rule) is adaptive_clip behind a tight screen: what it changes from adaptive_clip is this
# default (docs/methods.md, "The default rule: bounded", says why 3)
BOUNDED_SCREEN = 3.0
ROBUST_OPTIONS = {
    "screen": _SCREEN,
    "bound": Option(1.0, "clip: the L2 norm each update is clipped to (the scale of the model's updates: see a "
                    "run's norms in its rejections' reasons or use adaptive_clip)", low=0, low_open=True),
    "factor": Option(1.0, "adaptive_clip, bounded: clip each update's norm per coordinate held to this multiple of the "
                     "round's median", low=0, low_open=True),
    "trim": Option(0.1, "trimmed_mean: fraction of a coordinate's credited values cut from each end, in [0, 0.5)",
                   low=0, high=0.5, high_open=True),
    "faulty": Option(0.2, "multikrum: fraction f/n of a round's updates assumed faulty, in [0, 0.5)", low=0,
                     high=0.5, high_open=True),
}
# which robust_args each rule reads (the screen: every rule but none)
RULE_ARGS = {"none": (), "screen": ("screen",), "bounded": ("screen", "factor"), "clip": ("screen", "bound"),
             "adaptive_clip": ("screen", "factor"), "trimmed_mean": ("screen", "trim"), "median": ("screen",),
             "multikrum": ("screen", "faulty")}

ATTACK_OPTIONS = {
    "factor": Option(None, "scale: the delta times factor (default 10); sign_flip: times -factor (default 1)",
                     kind=float, low=0, low_open=True),
    "std": Option(1.0, "gaussian: standard deviation of the noise added on the coordinates a client holds",
                  low=0, low_open=True),
    "fraction": Option(0.1, "fraction of the clients (of `level`'s clients, if set) that attack, in (0, 1]; "
                       "drawn once from the run's seed", low=0, low_open=True, high=1),
    "level": Option(None, "draw the attackers among the clients that `system` gives this level (e.g. 1/4)",
                    kind=str),
    "clients": Option(None, "the attacking client ids, e.g. [3, 7] (instead of fraction/level)", kind=list),
}
ATTACK_ARGS = {"none": (), "scale": ("factor",), "sign_flip": ("factor",), "gaussian": ("std",), "nan": ()}
ATTACK_WHO = ("fraction", "level", "clients")


def _only(prefix: str, values: dict, allowed: tuple, owner: str) -> None:
    for key in values:
        if key not in allowed:
            raise ConfigError(f"{prefix}.{key}", f"does not apply to {owner}; its options: "
                              f"{', '.join(allowed) or 'none'}")


def check_robust(rule: str, args) -> dict:
    """robust_args checked for `rule` (one-line ConfigError naming the key), defaults filled."""
    out = check_options("robust_args", ROBUST_OPTIONS, args, "robust")
    _only("robust_args", args or {}, RULE_ARGS[rule], f"robust={rule}")
    if rule == "bounded" and "screen" not in (args or {}):
        out["screen"] = BOUNDED_SCREEN
    return out


def check_attack(kind: str, args, system) -> dict:
    """attack_args checked for `kind` against the run's `system` (client ids, level names)."""
    out = check_options("attack_args", ATTACK_OPTIONS, args, "attack")
    if kind == "none":
        _only("attack_args", args or {}, (), "attack=none")
        return out
    _only("attack_args", args or {}, ATTACK_ARGS[kind] + ATTACK_WHO, f"attack={kind}")
    if out["factor"] is None:
        out["factor"] = 10.0 if kind == "scale" else 1.0
    if out["clients"] is not None:
        if (args or {}).keys() & {"fraction", "level"}:
            raise ConfigError("attack_args.clients", "names the attackers; drop attack_args.fraction/level")
        bad = [c for c in out["clients"] if isinstance(c, bool) or not isinstance(c, int)
               or not 0 <= c < system.num_clients]
        if bad or not out["clients"]:
            raise ConfigError("attack_args.clients", f"expected client ids in 0..{system.num_clients - 1}, "
                              f"got {out['clients']!r}")
    if out["level"] is not None and system.find(out["level"]) is None:
        raise ConfigError("attack_args.level", f"{out['level']!r} is not a level of system "
                          f"({', '.join(lv.name for lv in system.levels)})")
    return out

"""What a config may say of the server step (`robust`, `robust_args`, `attack`, `attack_args`), read from the
registry: rules and attacks are classes that declare their options (fedlase/server_step.py: `Rule`, `Attack`),
registered in fedlase/registry.py (RULES, ATTACKS) like methods, so a plug-in module may add a rule of its own.
This half imports no torch and no rule module (the registry holds the classes), so validating a config stays
cheap (fedlase/config.py); here are the options several built-ins share."""
from __future__ import annotations

from .errors import ConfigError
from .options import Option, check_options
from .registry import ATTACKS, RULES

COVERAGES = ("mask", "nonzero", "kept")   # the `coverage` key's choices (fedlase/aggregate.py computes them)

SCREEN = Option(100.0, "reject an update whose norm per coordinate held exceeds this multiple of the round's "
                "median (every rule but none); non-finite updates and losses are always rejected", low=1)

# who attacks: every attack but `none` takes these
WHO = {
    "fraction": Option(0.1, "fraction of the clients (of `level`'s clients, if set) that attack, in (0, 1]; "
                       "drawn once from the run's seed", low=0, low_open=True, high=1),
    "level": Option(None, "draw the attackers among the clients that `system` gives this level (e.g. 1/4)",
                    kind=str),
    "clients": Option(None, "the attacking client ids, e.g. [3, 7] (instead of fraction/level)", kind=list),
}


def check_robust(rule: str, args) -> dict:
    """robust_args checked for the registered rule `rule`, defaults filled."""
    return RULES.get(rule).check_args(args or {})


def check_attack(kind: str, args, system) -> dict:
    """attack_args checked for the registered attack `kind` against the run's `system`, defaults filled."""
    return ATTACKS.get(kind).check_args(args or {}, system)


def check_stages(cfg, default_rule: str) -> None:
    """A method whose training some server stage does not reach (its `server_stages`: RecipFL's hypernetwork steps
    on what its clients trained of their generated models, not on the run's model a rule, attack or dp acts on; an
    adapter method aggregates in its own server step, where another rule or dp's calibration does not reach) is
    refused that stage in one line; under the default rule (`default_rule`) its screen still applies."""
    from .registry import METHODS
    stages = METHODS.get(cfg.method).server_stages
    for key, stage, used, value in (("robust", "rule", cfg.robust != default_rule, f"robust={cfg.robust}"),
                                    ("attack", "attack", cfg.attack != "none", f"attack={cfg.attack}"),
                                    ("dp", "dp", bool(cfg.dp), "dp")):
        if used and stage not in stages:
            raise ConfigError(key, f"method {cfg.method} takes no {value}: its server step is its own (RecipFL's "
                              f"hypernetwork, an adapter method's aggregation; its server_stages: "
                              f"{', '.join(stages) or 'none'}); drop it")


# ---- differential privacy (fedlase/privacy.py; docs/methods.md, "Differential privacy") ------------------------
DP = {
    "clip": Option(None, "the L2 bound C each client's update is clipped to, at the global shapes (setting any dp "
                   "key turns client-level DP on, and then clip is needed)", kind=float, low=0, low_open=True),
    "noise_multiplier": Option(None, "z: the Gaussian noise on a round's sum of clipped updates has standard "
                               "deviation z*C per coordinate; 0 clips without noise (epsilon is infinite)",
                               kind=float, low=0),
    "target_epsilon": Option(None, "instead of noise_multiplier: the z whose epsilon after `rounds` rounds is this "
                             "(dp_accounting's calibration)", kind=float, low=0, low_open=True),
    "delta": Option(None, "the delta epsilon is reported at; unset: min(1e-5, num_clients^-1.1), "
                    "well below 1/num_clients", kind=float, low=0,
                    low_open=True, high=1, high_open=True),
    "max_epsilon": Option(None, "stop the run before the first round whose epsilon would exceed this", kind=float,
                          low=0, low_open=True),
    "adaptive": Option(False, "adaptive clipping (Andrew et al. 2021): C follows target_quantile of the update "
                       "norms, steered by a noisy count of the unclipped updates, which is accounted for"),
    "target_quantile": Option(0.5, "dp.adaptive: the fraction of updates meant to fall under C", low=0, high=1),
    "clip_lr": Option(0.2, "dp.adaptive: the geometric step of C per round", low=0, low_open=True),
    "count_noise": Option(None, "dp.adaptive: standard deviation of the noise on the unclipped count; unset: the "
                          "expected clients per round / 20", kind=float, low=0, low_open=True),
}


def default_delta(n: int) -> float:
    """dp.delta unset: min(1e-5, n^-1.1), well below 1/n (delta = 1/n allows a mechanism that publishes one
    client's data outright)."""
    return min(1e-5, n ** -1.1)


def check_dp(cfg) -> dict:
    """The `dp` mapping checked against the run (one-line ConfigError naming the key), defaults filled; {}: off.
    `cfg.participation` is the parsed list."""
    from .registry import METHODS
    if not cfg.dp:
        return {}
    out = check_options("dp", DP, cfg.dp, "dp")
    try:
        import dp_accounting  # noqa: F401  (the accountant: an extra)
    except ImportError:
        raise ConfigError("dp", "needs Google's dp-accounting: pip install 'fedlase[privacy]'") from None
    if out["clip"] is None:
        raise ConfigError("dp.clip", "must be set: the L2 bound of each client's update (any dp key turns DP on)")
    if (out["noise_multiplier"] is None) == (out["target_epsilon"] is None):
        raise ConfigError("dp.noise_multiplier", "set exactly one of dp.noise_multiplier and dp.target_epsilon")
    if not RULES.get(cfg.robust).dp_safe:   # declared by the rule (Rule.dp_safe)
        safe = ", ".join(name for name, rule in RULES.items() if rule.dp_safe)
        raise ConfigError("robust", f"robust={cfg.robust} does not keep the clipped sum's sensitivity under dp "
                          f"(one client may move it by more than C); use {safe}")
    if METHODS.get(cfg.method).masks_from_data:
        raise ConfigError("method", f"{cfg.method} chooses a client's mask from its data, so which coordinates it "
                          "sent is private too; dp does not cover it")
    if cfg.label_split:
        raise ConfigError("label_split", "credits a client with its own classes' rows, which its data chooses; "
                          "dp does not cover it")
    if cfg.schedule != "sync":   # docs/async.md, "Differential privacy": not accounted for under asynchrony
        raise ConfigError("schedule", f"dp is accounted for synchronous rounds of sampled clients; under "
                          f"schedule={cfg.schedule} staleness weights, buffers and speed-chosen steps break its "
                          "sensitivity and sampling (docs/async.md)")
    if cfg.bn == "static":
        raise ConfigError("bn", "static recomputes BN statistics on clients' training samples, which dp does not "
                          "cover; use bn=batch")
    if cfg.eval_finetune > 0:
        raise ConfigError("eval_finetune", "trains each client's evaluated model on its data, which dp does not "
                          "cover; set eval_finetune=0")
    if out["adaptive"] and cfg.engine != "embedded":
        raise ConfigError("dp.adaptive", f"runs on engine=embedded only (a node would have to report whether it "
                          f"clipped); got engine={cfg.engine}")
    n = cfg.levels.num_clients
    if out["delta"] is None:   # well below 1/n: a delta of 1/n allows publishing one client's data outright
        out["delta"] = default_delta(n)
    elif out["delta"] >= 1 / n:
        raise ConfigError("dp.delta", f"{out['delta']:g} is at least 1/num_clients (1/{n}): a mechanism may then "
                          f"publish one client's data outright and still meet it; leave it unset for "
                          f"{default_delta(n):.3g}, or give one well below 1/{n}")
    if out["adaptive"] and out["count_noise"] is None:
        expected = sum(max(1, round(p * n)) for p in cfg.participation) / len(cfg.participation)
        out["count_noise"] = expected / 20
    z = out["noise_multiplier"]
    if out["adaptive"] and z is not None and z > 0 and z >= 2 * out["count_noise"]:
        raise ConfigError("dp.noise_multiplier", f"with dp.adaptive it must be below 2*dp.count_noise "
                          f"({2 * out['count_noise']:g}): the count's noise takes that share of the budget")
    return out

"""What a config may say of the server step (`robust`, `robust_args`, `attack`, `attack_args`), read from the
registry: rules and attacks are classes that declare their options (fedlase/robust.py: `Rule`, `Attack`),
registered in fedlase/registry.py (RULES, ATTACKS) like methods, so a plug-in module may add a rule of its own.
This half imports no torch and no rule module (the registry holds the classes), so validating a config stays
cheap (fedlase/config.py); here are the options several built-ins share."""
from __future__ import annotations

from .options import Option
from .registry import ATTACKS, RULES

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

"""One validation mechanism for everything a user sets: config keys, `method_args.*` and `analysis.*`.

An `Option` declares a setting once: default, help, allowed values or range, and whether it changes the
result (a run may resume with another `out` or `threads`, not with another `lr`). `check_value` turns a raw
value (from YAML or `key=value`) into a checked one or raises a one-line ConfigError naming the key."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping",
          list: "a list"}


# An Option's `tags`, so that a list of keys that some code treats alike is read from the declarations (a new key
# is declared once, with its tags), never kept by hand beside them:
TAGS = {
    "eval": "an evaluation setting: `fedlase evaluate` may change it on a finished run",
    "raw": "written as a raw string in key=value overrides, not read as YAML",
    "parsed": "a raw string that validation parses with its own rule (the system, the participation)",
    "path": "a file or folder of the run (a raw string; a Ray task gets it as an absolute path)",
    "submitter": "a file of the submitting machine only (a path): not sent to Flower's apps on other machines",
}


@dataclass(frozen=True)
class Option:
    default: Any
    help: str
    kind: type | None = None                     # default: the default's type (needed when default is None)
    choices: tuple | Callable[[], tuple] | None = None   # a callable reads a registry at check time
    low: float | None = None                     # numbers: range; every number must be finite
    high: float | None = None
    low_open: bool = False                       # True: > low, else >= low
    high_open: bool = False
    check: Callable[[Any], str | None] | None = None   # extra rule: returns why a value is wrong, or None
    affects_result: bool = True                  # False: may differ between a checkpoint and its resume
    tags: tuple[str, ...] = ()                   # what code elsewhere treats alike: one of TAGS each

    def __post_init__(self):
        if unknown := [t for t in self.tags if t not in TAGS]:
            raise ValueError(f"unknown Option tags {unknown}; known: {', '.join(TAGS)}")

    @property
    def type(self) -> type | None:
        return self.kind or (type(self.default) if self.default is not None else None)

    def allowed(self) -> tuple | None:
        return self.choices() if callable(self.choices) else self.choices


def _coerce(key: str, value, want: type | None):
    if want is None or value is None:
        return value
    if want in (int, float) and isinstance(value, str):   # YAML 1.1 reads '1e-2' as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if want is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if want is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, want) and not (want is int and isinstance(value, bool)):
        return value
    if want is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(key, f"expected {_KINDS.get(want, want.__name__)}, got {value!r}")


def _fmt(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def check_value(key: str, opt: Option, value):
    """The checked value, or ConfigError(key, ...). None passes for an option whose default is None."""
    value = _coerce(key, value, opt.type)
    if value is None:
        if opt.default is None:
            return None
        raise ConfigError(key, f"must be set ({opt.help})")
    if isinstance(value, str) and not value.strip():
        raise ConfigError(key, f"empty value; give one ({opt.help})")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value}")
    allowed = opt.allowed()
    if allowed is not None and value not in allowed:
        raise ConfigError(key, f"{value!r} is not one of {', '.join(_fmt(c) for c in allowed)}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if opt.low is not None and (value <= opt.low if opt.low_open else value < opt.low):
            raise ConfigError(key, f"must be {'>' if opt.low_open else '>='} {opt.low:g}, got {value:g}")
        if opt.high is not None and (value >= opt.high if opt.high_open else value > opt.high):
            raise ConfigError(key, f"must be {'<' if opt.high_open else '<='} {opt.high:g}, got {value:g}")
    if opt.check is not None:
        why = opt.check(value)
        if why:
            raise ConfigError(key, why)
    return value


def check_options(prefix: str, spec: dict[str, Option], values, owner: str) -> dict:
    """A mapping of options (method_args, one analysis' options) -> every option checked, defaults filled."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(prefix, f"expected a mapping of options, got {values!r}")
    for key in values:
        if key not in spec:
            known = ", ".join(spec) or "none"
            raise ConfigError(f"{prefix}.{key}", f"unknown option for {owner}; its options: {known}")
    return {k: check_value(f"{prefix}.{k}", o, values.get(k, o.default)) if k in values else o.default
            for k, o in spec.items()}

"""Resource levels and the system that assigns them to clients: the one home of both.

A system written `{1,1/4,1/16,1/64}_{10,20,30,40}` is an ordered list of levels (largest first, the papers'
order) with a client count each; clients are numbered level by level. A `Level` is looked up by its index and
holds its fraction exactly (`fractions.Fraction`), so no float is ever a dict key or compared with ==."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from .errors import ConfigError

_SYSTEM = re.compile(r"^\{([^{}]*)\}_\{([^{}]*)\}$")
_ALLOWED = ("written {levels}_{counts}, e.g. {1,1/4,1/16,1/64}_{10,20,30,40}: levels in (0,1], counts positive "
            "integers")


@dataclass(frozen=True, order=False)
class Level:
    """One resource level: the fraction of the budgeted parameters a client of this level may hold."""
    index: int            # position in System.levels (0 = the largest)
    fraction: Fraction
    count: int            # clients of this level under the fixed assignment

    @property
    def name(self) -> str:
        """The papers' notation: '1/16'."""
        return str(self.fraction)

    def __float__(self) -> float:
        return float(self.fraction)


def parse_level(text) -> Fraction:
    """'1/4', '0.25' or 0.25 -> Fraction(1, 4) (a decimal is read exactly as written)."""
    value = Fraction(str(text).strip())
    return value.limit_denominator(1 << 20) if value.denominator > 1 << 20 else value


def width_rate(level: float) -> float:
    """Parameter level -> width rate: a width rate r keeps about r^2 of a conv's parameters (fedlase/slicing.py)."""
    return math.sqrt(level)


def window_size(size: int, rate: float) -> int:
    """How many of `size` channels a window at `rate` keeps: ceil(rate * size), at least one (a width slice's, and
    a LoRA level's rank under a width method: fedlase/lora_config.py)."""
    return min(size, max(1, math.ceil(rate * size - 1e-9)))


def level_name(level) -> str:
    """0.0625, Fraction(1, 16) or a Level -> '1/16'."""
    if isinstance(level, Level):
        return level.name
    return str(Fraction(level).limit_denominator(1 << 20))


@dataclass(frozen=True)
class System:
    """The resource levels, largest first, and each client's level index. Clients are numbered level by
    level in the order the system is written (`{1/4,1}_{5,1}`: clients 0-4 at 1/4, client 5 at 1)."""
    levels: tuple[Level, ...]
    text: str = ""
    written: tuple[int, ...] = ()   # level indices in the order written (empty: largest first)

    @classmethod
    def parse(cls, text: str, key: str = "system") -> System:
        m = _SYSTEM.match(str(text).replace(" ", ""))
        if not m:
            raise ConfigError(key, f"cannot parse {text!r}; {_ALLOWED}")
        lv, ct = m.group(1).split(","), m.group(2).split(",")
        if len(lv) != len(ct):
            raise ConfigError(key, f"{len(lv)} levels but {len(ct)} counts in {text!r}; {_ALLOWED}")
        pairs = []
        for a, b in zip(lv, ct):
            try:
                frac = parse_level(a)
            except (ValueError, ZeroDivisionError):
                raise ConfigError(key, f"level {a!r} is not a number or fraction; {_ALLOWED}") from None
            if not 0 < frac <= 1:
                raise ConfigError(key, f"level {a} is outside (0,1]; {_ALLOWED}")
            if not re.fullmatch(r"\d+", b) or int(b) < 1:
                raise ConfigError(key, f"count {b!r} is not a positive integer; {_ALLOWED}")
            pairs.append((frac, int(b)))
        if len({f for f, _ in pairs}) != len(pairs):
            raise ConfigError(key, f"a level appears twice in {text!r}")
        return cls.of(pairs, text)

    @classmethod
    def of(cls, pairs, text: str = "") -> System:
        """From (fraction, count) pairs in any order; a bare list of fractions gives each one client."""
        pairs = [(p, 1) if not isinstance(p, tuple) else p for p in pairs]
        pairs = [(Fraction(f).limit_denominator(1 << 20) if not isinstance(f, Fraction) else f, n) for f, n in pairs]
        ordered = sorted(pairs, key=lambda p: -p[0])
        index = {f: i for i, (f, _) in enumerate(ordered)}
        return cls(tuple(Level(i, f, n) for i, (f, n) in enumerate(ordered)), text,
                   tuple(index[f] for f, _ in pairs))

    @property
    def smallest(self) -> Level:
        return self.levels[-1]

    @property
    def num_clients(self) -> int:
        return sum(lv.count for lv in self.levels)

    @property
    def client_level(self) -> tuple[int, ...]:
        """Level index of each client under the fixed assignment (clients numbered level by level)."""
        order = self.written or tuple(range(len(self.levels)))
        return tuple(i for i in order for _ in range(self.levels[i].count))

    def level_of(self, client: int) -> Level:
        """The level of a client under the fixed assignment."""
        return self.levels[self.client_level[client]]

    def find(self, fraction) -> Level | None:
        """The level whose fraction is exactly `fraction` (a Fraction, a '1/4' text or a float), or None."""
        try:
            f = fraction if isinstance(fraction, Fraction) else parse_level(fraction)
        except (ValueError, ZeroDivisionError):
            return None
        return next((lv for lv in self.levels if lv.fraction == f), None)

    def __iter__(self):
        return iter(self.levels)

    def __len__(self) -> int:
        return len(self.levels)


def as_system(levels) -> System:
    """A System from a System, or from level fractions (tests and library calls that pass [1, 0.25])."""
    return levels if isinstance(levels, System) else System.of(list(levels))

"""Device populations (issue 40): how the devices of one level differ, and when each is online.

Config `population` (unset: every device of a level exactly at its level's `device_model` values, always online):
- `speed_spread`, `bandwidth_spread`: sigma of a lognormal factor of median 1 on each client's speed and bandwidth
  (its level's value times the factor), drawn once from the run's seed.
- `online`, `offline`: mean seconds a client stays online, then offline (exponential durations, alternating;
  each client's own seeded stream; it starts online with probability online / (online + offline)).
- `capacity`, `behave`: a user's own FedScale trace instead: the pickled `client_device_capacity` ({id:
  {computation: ms per sample, communication: kbit/s}}) and `client_behave_trace` ({id: {active: [seconds],
  inactive: [seconds], finish_time: seconds, ...}}). They are read with fedlase's restricted unpickler
  (fedlase/safe_pickle.py), which builds plain data only: a pickle naming any function is refused in one line
  before anything in it runs.

How a trace maps onto fedlase's clients: trace ids in sorted order; fedlase client i takes the (i mod n)-th of
the n ids (a trace may be shorter than the population; FedScale reuses its devices the same way). Capacities:
the N devices so taken are ranked by speed (fastest first) and handed out by level, largest level first (levels
by speed quantile: the fastest devices hold the largest submodels; clients in the order the system numbers
them). Within a level, a client's speed is the level's `device_model` speed times its device's speed over the
median of that level's devices (likewise bandwidth): the device model sets each level's typical device, the
trace the spread around it. Availability: a client is online at time t when t modulo its device's
finish_time lies in one of its [active[k], inactive[k]) intervals (an unmatched last active lasts to
finish_time), as FedScale reads the trace; an interval that reaches finish_time runs on into the next cycle's
interval starting at 0 (a client online at both ends is never counted offline at the boundary).

A client that is offline cannot be picked; one that goes offline before its update would arrive is lost
(fedlase/simtime.py says how each schedule records it). Everything here is a function of the config and the
seed: a resumed run sees the same population."""
from __future__ import annotations

import bisect
import math
from pathlib import Path

import numpy as np

from .errors import DataError
from .sim_config import check_population


def _trace(path: str, what: str) -> list[tuple[object, dict]]:
    """(id, entry) of a FedScale trace pickle, ids in sorted order; DataError in one line when it is not one."""
    from .safe_pickle import load_plain_pickle
    raw = load_plain_pickle(Path(path).expanduser(), what, encoding="ASCII")
    if not isinstance(raw, dict) or not raw:
        raise DataError(f"{path}: not {what}: expected a non-empty mapping of client id to its entry")
    ids = sorted(raw, key=lambda k: (not isinstance(k, int), k if isinstance(k, int) else 0, str(k)))
    for k in ids:
        if not isinstance(raw[k], dict):
            raise DataError(f"{path}: not {what}: client {k!r}'s entry is not a mapping")
    return [(k, raw[k]) for k in ids]


def _number(path, what, k, entry, key) -> float:
    v = entry.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise DataError(f"{path}: not {what}: client {k!r} has {key}={v!r}, expected a positive number")
    return float(v)


class Availability:
    """When each client is online: `online(c, t)`, `offline_at(c, t)` (when an online client next goes offline;
    inf: never) and `next_online(t, clients)` (the earliest time from t on that one of `clients`, default all,
    is online)."""

    def online(self, c: int, t: float) -> bool:
        raise NotImplementedError

    def offline_at(self, c: int, t: float) -> float:
        raise NotImplementedError

    def next_online(self, t: float, clients=None) -> float:
        raise NotImplementedError


class OnOff(Availability):
    """Alternating exponential online/offline durations per client, from its own seeded stream; the switch times
    are drawn lazily and never change once drawn (a function of (seed, client) only)."""

    def __init__(self, n: int, online: float, offline: float, seed: int):
        from .sampling import Stream, derive_seed
        self.means = (online, offline)
        self.rngs = [np.random.default_rng(derive_seed(seed, c, Stream.AVAILABILITY)) for c in range(n)]
        self.first = [bool(r.random() < online / (online + offline)) for r in self.rngs]
        self.switches: list[list[float]] = [[] for _ in range(n)]

    def _until(self, c: int, t: float) -> list[float]:
        s = self.switches[c]
        while not s or s[-1] <= t:
            state_online = self.first[c] ^ (len(s) % 2 == 1)
            s.append((s[-1] if s else 0.0) + float(self.rngs[c].exponential(self.means[0 if state_online else 1])))
        return s

    def online(self, c, t):
        s = self._until(c, t)
        return self.first[c] ^ (bisect.bisect_right(s, t) % 2 == 1)

    def offline_at(self, c, t):
        s = self._until(c, t)
        return s[bisect.bisect_right(s, t)]   # an online client's next switch takes it offline

    def next_online(self, t, clients=None):
        best = math.inf
        for c in range(len(self.rngs)) if clients is None else clients:
            s = self._until(c, t)
            i = bisect.bisect_right(s, t)
            best = min(best, t if self.first[c] ^ (i % 2 == 1) else s[i])
        return best


class TraceAvailability(Availability):
    """FedScale's behaviour trace: online in [active[k], inactive[k]) of each cycle of finish_time seconds."""

    def __init__(self, entries: list[tuple[list[tuple[float, float]], float]]):
        self.entries = [(self._merged(iv), cycle) for iv, cycle in entries]   # per client: (its intervals, cycle)

    @staticmethod
    def _merged(intervals):
        """The intervals sorted, overlapping or touching ones joined: a client online across a boundary between
        two of them never goes offline there."""
        out: list[tuple[float, float]] = []
        for a, b in sorted(intervals):
            if out and a <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
        return out

    def _where(self, c, t):
        intervals, cycle = self.entries[c]
        base = math.floor(t / cycle) * cycle
        return intervals, cycle, base, t - base

    def online(self, c, t):
        intervals, _, _, x = self._where(c, t)
        return any(a <= x < b for a, b in intervals)

    def offline_at(self, c, t):
        intervals, cycle, base, x = self._where(c, t)
        end = next((b for a, b in intervals if a <= x < b), None)
        if end is None:
            return t
        if end >= cycle and intervals[0][0] <= 0:   # online at the cycle's end and at the next one's start
            first = intervals[0][1]
            return math.inf if first >= cycle else base + cycle + first
        return base + end

    def next_online(self, t, clients=None):
        best = math.inf
        for c in range(len(self.entries)) if clients is None else clients:
            intervals, cycle, base, x = self._where(c, t)
            if self.online(c, t):
                return t
            if not intervals:
                continue
            later = [a for a, _ in intervals if a > x] or [intervals[0][0] + cycle]   # else: the next cycle's
            best = min(best, base + min(later))
        return best


class Population:
    """Per client: a factor on its level's speed and one on its bandwidth (`speed`, `bandwidth`: numpy arrays of
    1.0 without spread), and its availability (None: always online)."""

    def __init__(self, speed: np.ndarray, bandwidth: np.ndarray, availability: Availability | None):
        self.speed, self.bandwidth, self.availability = speed, bandwidth, availability

    @classmethod
    def of(cls, args: dict | None, system, seed: int) -> Population:
        """The population the config's `population` (`args`) describes for `system`'s clients."""
        n = system.num_clients
        args = check_population(args or {})
        from .sampling import Stream, derive_seed
        rng = np.random.default_rng(derive_seed(seed, 0, Stream.POPULATION))
        speed = np.exp(args["speed_spread"] * rng.standard_normal(n)) if args["speed_spread"] else np.ones(n)
        bandwidth = (np.exp(args["bandwidth_spread"] * rng.standard_normal(n)) if args["bandwidth_spread"]
                     else np.ones(n))
        if args["capacity"] is not None:
            speed, bandwidth = cls._capacities(args["capacity"], system)
        availability = None
        if args["online"] is not None:
            availability = OnOff(n, args["online"], args["offline"], seed)
        elif args["behave"] is not None:
            availability = cls._behaviour(args["behave"], n)
        return cls(speed, bandwidth, availability)

    @staticmethod
    def _capacities(path: str, system) -> tuple[np.ndarray, np.ndarray]:
        what = "a FedScale client_device_capacity trace"
        trace = _trace(path, what)
        n = system.num_clients
        devices = [trace[i % len(trace)] for i in range(n)]
        speed = np.array([1.0 / _number(path, what, k, e, "computation") for k, e in devices])
        bw = np.array([_number(path, what, k, e, "communication") for k, e in devices])
        # levels by speed quantile: fastest devices to the largest level (clients in the system's order)
        order = np.argsort(-speed, kind="stable")
        clients = sorted(range(n), key=lambda c: (system.client_level[c], c))
        s_of, b_of = np.empty(n), np.empty(n)
        s_of[clients], b_of[clients] = speed[order], bw[order]
        for lvl in range(len(system.levels)):   # relative to the median device of the level
            members = [c for c in range(n) if system.client_level[c] == lvl]
            if members:
                s_of[members] /= np.median(s_of[members])
                b_of[members] /= np.median(b_of[members])
        return s_of, b_of

    @staticmethod
    def _behaviour(path: str, n: int) -> TraceAvailability:
        what = "a FedScale client_behave_trace"
        trace = _trace(path, what)
        entries = []
        for k, e in trace:
            cycle = _number(path, what, k, e, "finish_time")
            active, inactive = e.get("active"), e.get("inactive")
            if not isinstance(active, list) or not isinstance(inactive, list) or \
                    not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in active + inactive):
                raise DataError(f"{path}: not {what}: client {k!r} needs active and inactive lists of seconds")
            ends = [float(x) for x in inactive] + [cycle] * max(0, len(active) - len(inactive))
            entries.append(([(float(a), b) for a, b in zip(active, ends) if b > a], cycle))
        return TraceAvailability([entries[i % len(entries)] for i in range(n)])

    def spread(self, level_of: list[int], levels: int) -> list[tuple[float, float, float]]:
        """Per level: (min, median, max) of its clients' speed factors, for `fedlase cost`."""
        out = []
        for lvl in range(levels):
            f = self.speed[[c for c, lv in enumerate(level_of) if lv == lvl]]
            out.append((float(f.min()), float(np.median(f)), float(f.max())) if len(f) else (1.0, 1.0, 1.0))
        return out

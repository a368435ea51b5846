"""Simulated time (issue 30): how long each round would take on the clients' own devices.

A device model gives each level a compute speed (FLOP/s), a bandwidth (bytes/s) and optionally a memory (bytes).
Config `device_model` (unset: the defaults below): each of `speed`, `bandwidth`, `memory` is either one number,
a level-1 device's (a level-l device gets l of it: the papers' reading, a device of level l holds and computes l of
the model), or a list with one value per level, largest level first. Defaults: speed 1e10 FLOP/s, bandwidth
1.25e6 bytes/s (10 Mbit/s), no memory limit; assumptions, to be set to the devices one has in mind.

A sampled client's time = its step FLOPs x its local steps / its speed + (down + up payload) / its bandwidth,
with the step FLOPs of fedlase/cost.py: `sim_charge=dense` charges what fedlase computes (a masked method the
full model's FLOPs), `sparse` the FLOPs if the submodel's sparsity were exploited (the same for a width slice).
A synchronous round lasts as long as its slowest client. With `deadline` (simulated seconds), a client that would
take longer is dropped before it trains (recorded, `missed_deadline`), and a round with a dropped client lasts
the deadline (the server waits for it). A client whose level needs more memory than its device has is flagged
(`over_memory`), not dropped: the level's measured training peak where `fedlase cost` measured one, else the cost
table's estimate (fedlase/cost.py: a frozen base, which every LoRA client holds whole, the held weights, their
gradients, the optimizer state and the activations), so a level that cannot hold the base is flagged.

Everything follows from the config, the round's sampled clients (fedlase/sampling.py: a function of the seed
and the round) and the cost table, so the time of a finished run can be recomputed without training again
(`fedlase report`), except under a deadline, which changes who trains: deadline runs must be trained. The cost
table is taken once, on round 1's submodels: a method whose submodel sizes follow the weights (fedlase_width's
widths, a threshold method's payload) is charged its round-1 sizes throughout."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from .population import Population
from .sim_config import DEVICE_KEYS

DEFAULTS = dict(zip(DEVICE_KEYS, (1e10, 1.25e6, None)))   # speed, bandwidth, memory of a level-1 device


@dataclass(frozen=True)
class DeviceModel:
    """Per level (largest first): speed in FLOP/s, bandwidth in bytes/s, memory in bytes (None: unlimited)."""
    speed: tuple[float, ...]
    bandwidth: tuple[float, ...]
    memory: tuple[float | None, ...]

    @classmethod
    def of(cls, value: dict | None, fractions: list[float]) -> DeviceModel:
        got = {**DEFAULTS, **(value or {})}

        def per_level(key):
            v = got[key]
            if v is None:
                return tuple(None for _ in fractions)
            return tuple(float(x) for x in v) if isinstance(v, list) else tuple(float(v) * f for f in fractions)
        return cls(per_level("speed"), per_level("bandwidth"), per_level("memory"))


class SimClock:
    """The simulated time of a run's rounds, from its config and cost table (`fedlase.cost.level_costs`).
    `steps[c]`: client c's local steps a round."""

    def __init__(self, cfg, costs, steps: dict[int, int], charge: str | None = None):
        from .sampling import Sampling
        self.cfg, self.costs, self.steps = cfg, costs, steps
        self.charge = charge or cfg.sim_charge
        self.device = DeviceModel.of(cfg.device_model, [c.fraction for c in costs])
        self.deadline = cfg.deadline
        self.sampling = Sampling.from_config(cfg)
        # fedlase/population.py: per-client spread and availability (None: a level's devices alike, always on)
        self.population = None if cfg.population is None else Population.of(cfg.population, cfg.levels, cfg.seed)
        self.availability = self.population.availability if self.population is not None else None
        self._ends: list[float] = [0.0]   # cumulative time at the end of round r (index r)

    def client_time(self, client: int, level_index: int) -> float:
        c, d = self.costs[level_index], self.device
        flops = c.step_flops if self.charge == "dense" else c.sparse_flops
        speed, bandwidth = d.speed[level_index], d.bandwidth[level_index]
        if self.population is not None:
            speed, bandwidth = speed * self.population.speed[client], bandwidth * self.population.bandwidth[client]
        compute = flops * self.steps[client] / speed
        return float(compute + (c.down_bytes + c.up_bytes) / bandwidth)

    def online(self, client: int, t: float) -> bool:
        return self.availability is None or self.availability.online(client, t)

    def dispatch(self, client: int, level_index: int, t: float) -> tuple[float, bool]:
        """(when a client sent at time t returns, whether it is lost): a client that goes offline before its update
        would arrive is lost at the moment it goes offline."""
        end = t + self.client_time(client, level_index)
        off = math.inf if self.availability is None else self.availability.offline_at(client, t)
        return (off, True) if off < end else (end, False)

    def next_online(self, t: float, clients=None) -> float:
        """The earliest time from t on that one of `clients` (default: any) is online."""
        return t if self.availability is None else self.availability.next_online(t, clients)

    def round(self, rnd: int, picked=None) -> dict:
        """This round's clients' fates: {"time", "kept" [(client, level)], "missed" [clients], "over_memory"
        [clients]}. `picked`: the round's sampled (client, level) pairs (default: drawn from the config)."""
        from .sampling import sample_clients
        picked = sample_clients(self.sampling, rnd) if picked is None else picked
        offline, lost = [], {}
        if self.availability is not None:   # who is offline at the round's start, and who drops out during it
            start = self.elapsed(rnd - 1)
            offline = [c for c, _ in picked if not self.online(c, start)]
            picked = [(c, lvl) for c, lvl in picked if c not in offline]
            for c, lvl in picked:
                end, gone = self.dispatch(c, lvl.index, start)
                if gone:
                    lost[c] = end - start
        times = {c: self.client_time(c, lvl.index) for c, lvl in picked}
        missed = [c for c, t in times.items() if self.deadline is not None and t > self.deadline]
        kept = [(c, lvl) for c, lvl in picked if c not in missed and c not in lost]
        # the server waits for its last client to return or to drop out
        slowest = max([times[c] for c, _ in kept] + [t for c, t in lost.items() if c not in missed], default=0.0)
        if offline and not kept and not lost:   # nobody to wait for: the round lasts until one comes back
            slowest = self.availability.next_online(start, offline) - start
        over = [c for c, lvl in picked if self.device.memory[lvl.index] is not None
                and self.costs[lvl.index].need_bytes is not None
                and self.costs[lvl.index].need_bytes > self.device.memory[lvl.index]]
        return {"time": self.deadline if missed else slowest, "kept": kept, "missed": missed, "over_memory": over,
                "offline": offline, "lost": [c for c in lost if c not in missed]}

    def elapsed(self, rnd: int) -> float:
        """Simulated time at the end of round `rnd` (rounds 1..rnd, computed once each)."""
        while len(self._ends) <= rnd:
            self._ends.append(self._ends[-1] + self.round(len(self._ends))["time"])
        return self._ends[rnd]

    def record(self) -> dict:
        """What recomputes this run's simulated time without its data: the cost table and each client's steps
        (`recorded_clock`; the engine writes it to the run's sim.json)."""
        return {"costs": [c.to_dict() for c in self.costs], "steps": {str(c): n for c, n in self.steps.items()}}

    def admit(self, picked, rnd: int):
        """(the clients that train, the metrics fields of this round) for the engine's round loop."""
        fate = self.round(rnd, picked)
        stats = {"sim_time": self.elapsed(rnd - 1) + fate["time"], "sim_round_time": fate["time"]}
        if fate["missed"]:
            stats["missed_deadline"] = fate["missed"]
        if fate["over_memory"]:
            stats["over_memory"] = fate["over_memory"]
        if fate["offline"]:
            stats["offline"] = fate["offline"]
        if fate["lost"]:
            stats["lost_offline"] = fate["lost"]
        return fate["kept"], stats


def client_steps(trainer) -> dict[int, int]:
    """Every client's local steps a round (fixed unless local_epochs is set), from a run's client trainer."""
    return {c: trainer.work.num_steps(len(idx)) for c, idx in trainer.train_idx.items()}


def clock_for(cfg, parts, charge: str | None = None) -> SimClock | None:
    """The SimClock of a run's parts (fedlase.engine.build_parts), or None when its config asks for no simulated
    time (no device_model and no deadline): what callers hand to the engine (`run_experiment(cfg, clock=
    clock_for)`). Measures memory (child processes) only when the device model gives one."""
    if not cfg.simulated and charge is None:
        return None
    from .cost import level_costs, with_memory
    p = parts
    costs = level_costs(p.model, p.method, p.trainer, p.levels, p.level_clients)
    if cfg.device_model and cfg.device_model.get("memory"):
        costs = with_memory(costs, cfg)
    return SimClock(cfg, costs, client_steps(p.trainer), charge)


def recorded_clock(cfg, record: dict, charge: str | None = None) -> SimClock:
    """The SimClock of a finished run from what it recorded (`SimClock.record`, the run's sim.json): no data
    loaded, nothing trained."""
    from .cost import LevelCost
    return SimClock(cfg, [LevelCost(**c) for c in record["costs"]], {int(c): n for c, n in record["steps"].items()},
                    charge)


def time_spread_table(cfg, costs) -> str:
    """The population per level (`fedlase cost`): the spread of its clients' simulated times (dense charge, each
    client at its level's steps of the cost table), min / median / max over the clients the system gives it."""
    system = cfg.levels
    steps = {c: costs[system.client_level[c]].steps for c in range(cfg.num_clients)}
    clock = SimClock(cfg, costs, steps, "dense")
    lines = ["Client time per level (dense charge, simulated seconds a round)\n",
             "| level | clients | min | median | max |", "|---|---|---|---|---|"]
    for lvl in system.levels:
        members = [c for c in range(cfg.num_clients) if system.client_level[c] == lvl.index]
        times = sorted(clock.client_time(c, lvl.index) for c in members)
        if times:
            lines.append(f"| {lvl.name} | {len(times)} | {times[0]:.4g} | {statistics.median(times):.4g} | "
                         f"{times[-1]:.4g} |")
    return "\n".join(lines)


"""Asynchronous schedules on the embedded engine: fedbuff and fedasync (options and staleness weights:
fedlase/sim_config.py; docs/async.md), an event loop on the simulated clock (fedlase/simtime.py).

The server keeps `concurrency` clients busy. Clients are drawn in the order the synchronous rounds would draw
them (fedlase/sampling.py: round 1's sample, then round 2's, ...), a client that is already training or is
offline being passed over; each keeps the level its draw gives it. A client's update is computed when it is
dispatched, on the model version it receives (its level's submodel of that version, computed once per level and
version, with the round number version + 1, and the batches of the round it was drawn in), and is delivered at
its arrival time (its simulated time: fedlase/simtime.py). So the engine holds deltas in flight, never old model
versions. A client that goes offline before it would arrive is never trained: it frees its slot when it goes
offline, recorded in the next step's `lost_offline`.

At each instant the loop delivers every arrival due then (the attack applies to each arrival), then, while the
buffer holds `buffer` updates, the server steps on the first of them (fedlase/engine.py, `Experiment.serve`: the
screen, the rule, the trackers, per buffer), then fills the free slots from the current model. With equal client
times, every client online, concurrency = buffer = the clients a round samples and a constant staleness weight,
this is the synchronous run, bit for bit (tests/test_async.py).

What is held, and its memory: per client in flight its delta (a width slice's gathered, a masked method's full
size: at most `concurrency` deltas, plus up to `buffer` arrived ones), its loss, and the masks and slices of
the submodel it trained (shared by the clients of one level and version; no thresholds, scales or local
objective: only what aggregation credits). All of it is plain data in the checkpoint (`state_dict`), so a run
killed at any moment resumes bit-identical from its last checkpoint."""
from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass

from .errors import UserError
from .masks import Submodel
from .sampling import sample_clients
from .sim_config import schedule_settings, staleness_weight


@dataclass
class Flight:
    """One dispatched client: when it arrives (or is lost), and its update (None when lost)."""
    arrival: float
    seq: int        # dispatch order: breaks ties between equal arrival times
    client: int
    level: int      # its level's index
    draw: int       # the sampling round it was drawn from (its batches' round)
    version: int    # the model version it trained on (server steps taken then)
    lost: bool
    update: object | None = None   # the engine's Update

    def __lt__(self, other):
        return (self.arrival, self.seq) < (other.arrival, other.seq)


class AsyncSchedule:
    """The event loop of `schedule=fedbuff|fedasync`; `step(exp, rnd)` runs it up to the next server step."""

    def __init__(self, cfg):
        self.kind, self.args = cfg.schedule, schedule_settings(cfg)
        self.now, self.seq, self.draw, self.pos = 0.0, 0, 1, 0
        self.flight: list[Flight] = []   # a heap by (arrival, seq)
        self.buffer: list[Flight] = []   # arrived, not yet applied, in arrival order
        self.lost: list[int] = []        # clients lost offline since the last step
        self.skipped = 0                 # drawn clients passed over offline since the last step
        self._drawn: tuple[int, list] = (0, [])
        self._subs: tuple[int, dict] = (-1, {})

    # ---- the loop ----------------------------------------------------------------------------------------------
    def step(self, exp, rnd: int) -> dict:
        """Deliver arrivals and dispatch clients until the buffer is full, then take server step `rnd`."""
        while len(self.buffer) < self.args["buffer"]:
            self._fill(exp)
            if not self.flight:   # nobody could be sent: wait for someone to come online
                t = exp.clock.next_online(self.now)
                if math.isinf(t):
                    raise UserError("population: no client is online again after simulated time "
                                    f"{self.now:.1f}s; nothing can train")
                self.now = max(t, self.now)
                continue
            self.now = self.flight[0].arrival
            while self.flight and self.flight[0].arrival == self.now:
                f = heapq.heappop(self.flight)
                if f.lost:
                    self.lost.append(f.client)
                    if len(self.lost) > 100 * exp.cfg.num_clients:   # else the loop would never end
                        raise UserError("population: clients keep going offline before their updates arrive "
                                        f"({len(self.lost)} lost since the last server step); lengthen "
                                        "population.online or shorten the clients' times")
                else:   # the attack, per arrival (simulation only)
                    f.update = exp._attacked(f.update, {}, f.draw)
                    self.buffer.append(f)
        return self._apply(exp, rnd)

    def _candidate(self, exp):
        """The next (client, level, draw) in the synchronous rounds' order."""
        if self._drawn[0] != self.draw:
            self._drawn = (self.draw, sample_clients(exp.sampling, self.draw))
        picked = self._drawn[1]
        c, lvl = picked[self.pos]
        out = (c, lvl, self.draw)
        self.pos += 1
        if self.pos == len(picked):
            self.draw, self.pos = self.draw + 1, 0
        return out

    def _fill(self, exp) -> None:
        """Dispatch clients into the free slots at `now`, each trained at once on the current model."""
        free = self.args["concurrency"] - len(self.flight)
        busy = {f.client for f in self.flight}
        chosen = []
        for _ in range(exp.cfg.num_clients if free > 0 else 0):   # one population's worth of draws at most
            c, lvl, draw = self._candidate(exp)
            if c in busy:
                continue
            if not exp.clock.online(c, self.now):
                self.skipped += 1
                continue
            busy.add(c)
            chosen.append((c, lvl, draw))
            if len(chosen) == free:
                break
        if not chosen:
            return
        version = exp.round
        sent = []
        for c, lvl, draw in chosen:
            arrival, lost = exp.clock.dispatch(c, lvl.index, self.now)
            sent.append(Flight(arrival, self.seq, c, lvl.index, draw, version, lost))
            self.seq += 1
        trainees = [f for f in sent if not f.lost]
        if self._subs[0] != version:
            self._subs = (version, {})
        subs = self._subs[1]
        need = {exp.levels[f.level] for f in trainees} - subs.keys()
        subs.update(exp.submodels(need, version + 1) if need else {})
        stripped: dict[int, Submodel] = {}
        for draw in sorted({f.draw for f in trainees}):   # the runner trains one round's batches at a time
            group = [f for f in trainees if f.draw == draw]
            picked = [(f.client, exp.levels[f.level]) for f in group]
            result = exp.runner.train(exp, draw, picked, {lv: subs[lv] for _, lv in picked})
            by_client = {u.client: u for u in result.updates}
            for f in group:
                u = by_client[f.client]
                sub = u.sub or subs[exp.levels[f.level]]
                if id(sub) not in stripped:   # what aggregation credits: its masks and slices
                    stripped[id(sub)] = Submodel(masks=sub.masks, slices=sub.slices)
                f.update = dataclasses.replace(u, sub=stripped[id(sub)])
        for f in sent:
            heapq.heappush(self.flight, f)

    def _apply(self, exp, rnd: int) -> dict:
        """Server step `rnd` on the first `buffer` arrived updates, staleness-weighted."""
        batch, self.buffer = self.buffer[:self.args["buffer"]], self.buffer[self.args["buffer"]:]
        taus = [exp.round - f.version for f in batch]
        bound = self.args["max_staleness"]
        stale = [f.client for f, t in zip(batch, taus) if bound is not None and t > bound]
        kept = [(f, t) for f, t in zip(batch, taus) if bound is None or t <= bound]
        weights = [staleness_weight(self.args, t) for _, t in kept]
        if self.kind == "fedbuff":
            updates = [dataclasses.replace(f.update, weight=w) for (f, _), w in zip(kept, weights)]
            step_size = self.args["server_lr"]
        else:   # fedasync: one update; its staleness scales the mixing
            updates = [f.update for f, _ in kept]
            step_size = self.args["mixing"] * (weights[0] if weights else 1.0)
        shares: dict[str, int] = {}
        for f, _ in kept:
            name = exp.levels[f.level].name
            shares[name] = shares.get(name, 0) + 1
        extra = {"sim_time": self.now, "staleness": taus, "level_updates": shares, "in_flight": len(self.flight)}
        if self.lost:
            extra["lost_offline"] = self.lost
        if self.skipped:
            extra["offline_skipped"] = self.skipped
        if stale:
            extra["too_stale"] = stale
        self.lost, self.skipped = [], 0
        return exp.serve(rnd, updates, {}, extra, step_size)

    # ---- state: plain data (fedlase/checkpoint.py) ----------------------------------------------------------
    def state_dict(self) -> dict:
        subs: dict[int, int] = {}
        table = []

        def plain(f: Flight) -> dict:
            out = {k: getattr(f, k) for k in ("arrival", "seq", "client", "level", "draw", "version", "lost")}
            if f.update is not None:
                u = f.update
                if id(u.sub) not in subs:
                    subs[id(u.sub)] = len(table)
                    table.append({"masks": u.sub.masks, "slices": u.sub.slices})
                out.update(delta=u.delta, loss=u.loss, sub=subs[id(u.sub)])
            return out
        return {"now": self.now, "seq": self.seq, "draw": self.draw, "pos": self.pos, "lost": list(self.lost),
                "skipped": self.skipped, "flight": [plain(f) for f in sorted(self.flight)],
                "buffer": [plain(f) for f in self.buffer], "subs": table}

    def load_state_dict(self, state: dict, exp, Update) -> None:
        """Back from `state_dict`; `Update`: the engine's (fedlase/engine.py, which imports this module)."""
        dev = exp.device
        table = [Submodel(masks={k: v.to(dev) for k, v in s["masks"].items()},
                          slices={k: tuple(None if i is None else i.to(dev) for i in v)
                                  for k, v in s["slices"].items()}) for s in state["subs"]]

        def flight(d: dict) -> Flight:
            f = Flight(*(d[k] for k in ("arrival", "seq", "client", "level", "draw", "version", "lost")))
            if "delta" in d:
                f.update = Update(f.client, exp.levels[f.level], {k: v.to(dev) for k, v in d["delta"].items()},
                                  d["loss"], table[d["sub"]])
            return f
        self.now, self.seq, self.draw, self.pos = state["now"], state["seq"], state["draw"], state["pos"]
        self.lost, self.skipped = list(state["lost"]), state["skipped"]
        self.flight = [flight(d) for d in state["flight"]]
        heapq.heapify(self.flight)
        self.buffer = [flight(d) for d in state["buffer"]]
        self._drawn, self._subs = (0, []), (-1, {})

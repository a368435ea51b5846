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
killed at any moment resumes bit-identical from its last checkpoint.

The arrival record: every run writes `arrivals.jsonl` into its folder, one line per arrival, written at the step
that applies or drops it: its place in the order of arrival, its dispatch number `seq`, the client, its level,
draw and the version it trained on, the step and its staleness, or why it was dropped. `schedule_args.replay`
names such a record (or the run folder holding one): the loop then takes its arrivals in the recorded order
instead of by simulated time. Whom it dispatches next follows from that order alone, so it rebuilds the recorded
run's updates and steps, bit for bit on the same machine. A Flower deployment (fedlase/flower/buffered.py) runs
this loop with its nodes' replies as arrivals and writes the same record."""
from __future__ import annotations

import dataclasses
import heapq
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .errors import UserError
from .masks import Submodel
from .sampling import sample_clients
from .sim_config import schedule_settings, staleness_weight
from .util import atomic_write, lines_up_to

RECORD = "arrivals.jsonl"   # the arrival record, in the run folder
TOTALS = ("lost_offline", "failed", "offline_skipped", "too_stale")   # counted over the run (`totals`)


class ScheduleClock(Protocol):
    """What the event loop reads of the simulated clock (fedlase/simtime.py's SimClock)."""
    def online(self, client: int, t: float) -> bool: ...

    def next_online(self, t: float) -> float: ...

    def dispatch(self, client: int, level_index: int, t: float) -> tuple[float, bool]:
        """(when a client sent at time t arrives, whether it is lost on the way)."""


class ServerPort(Protocol):
    """What the event loop may use of the run it schedules (the engine's `Experiment` is one): the run's
    settings, levels and device, whom to draw (`sampling`) and when they are online and arrive (`clock`), the
    model version (`round`), and four actions: a level's submodel of a version, training a draw's clients
    (`runner`), an update as the server receives it (the attack), and a server step on arrived updates. The loop
    hands the port on to the runner (and Flower's to its nodes' messages): so it also carries what a runner reads
    (fedlase.engine.RunnerPort: trainer, params, buffers, server, frozen)."""
    cfg: Any
    levels: list
    sampling: Any
    clock: ScheduleClock
    runner: Any     # the engine's RoundRunner
    device: Any
    round: int
    trainer: Any    # these five: what the runner reads of the port it is handed
    params: dict
    buffers: dict
    server: Any
    frozen: dict | None

    def submodels(self, levels, rnd: int) -> dict: ...

    def receive(self, u, subs: dict, rnd: int): ...

    def serve(self, rnd: int, updates: list, subs: dict, extra: dict, step_size: float = 1.0) -> dict: ...


@dataclass
class Flight:
    """One dispatched client: when it arrives (or is lost), and its update (None when lost or failed)."""
    arrival: float
    seq: int        # dispatch order: breaks ties between equal arrival times
    client: int
    level: int      # its level's index
    draw: int       # the sampling round it was drawn from (its batches' round)
    version: int    # the model version it trained on (server steps taken then)
    lost: bool
    update: object | None = None   # the engine's Update
    failed: str | None = None      # why its update never came (a Flower node's error or a rejected reply)
    order: int = 0                 # its place in the order of arrival (1, 2, ...), once it has arrived
    instant: int = 0               # the instant it arrived at (arrivals of one instant are delivered together)

    def __lt__(self, other):
        return (self.arrival, self.seq) < (other.arrival, other.seq)


def read_record(path) -> list[dict]:
    """The arrivals of a record (`RECORD`, or a run folder holding one) in the order they arrived; a one-line
    UserError if it cannot be one."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / RECORD
    try:
        rows = sorted((json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()),
                      key=lambda r: r["arrival"])
        ok = [r["arrival"] for r in rows] == list(range(1, len(rows) + 1)) and all(
            isinstance(r["seq"], int) and isinstance(r["client"], int) for r in rows)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"schedule_args.replay: cannot read {path} as an arrival record ({type(e).__name__}: "
                        f"{e})") from None
    if not ok:
        raise UserError(f"schedule_args.replay: {path} is not an arrival record (arrivals 1..n, each with its "
                        "seq and client)")
    return rows


def credited(sub: Submodel, seen: dict[int, Submodel]) -> Submodel:
    """What aggregation credits of a submodel (its masks and slices), one copy per submodel (`seen`: id of a
    submodel -> its copy, kept only while those submodels are alive)."""
    if id(sub) not in seen:
        seen[id(sub)] = Submodel(masks=sub.masks, slices=sub.slices)
    return seen[id(sub)]


def by_draw(exp: ServerPort, flights: list[Flight]):
    """The flights by the round whose batches they train, in round order: (draw, its flights, their (client,
    level) pairs)."""
    for draw in sorted({f.draw for f in flights}):
        group = [f for f in flights if f.draw == draw]
        yield draw, group, [(f.client, exp.levels[f.level]) for f in group]


class AsyncSchedule:
    """The event loop of `schedule=fedbuff|fedasync`; `step(exp, rnd)` runs it up to the next server step."""

    TIME = "sim_time"   # what `now` is, in the metrics line (a Flower deployment's is the wall clock)

    def __init__(self, cfg):
        self.kind, self.args = cfg.schedule, schedule_settings(cfg)
        self.now, self.seq, self.draw, self.pos = 0.0, 0, 1, 0
        self.flight: list[Flight] = []   # a heap by (arrival, seq)
        self.buffer: list[Flight] = []   # arrived, not yet applied, in arrival order
        self.lost: list[int] = []        # clients lost offline since the last step
        self.failed: list[int] = []      # clients whose update failed since the last step (Flower)
        self.skipped = 0                 # drawn clients passed over offline since the last step
        # the same counts over the whole run: a metrics line is written only at evaluated steps, so the
        # per-step fields above would miss the steps in between
        self.totals = dict.fromkeys(TOTALS, 0)
        self.arrived, self.instant = 0, 0   # arrivals so far, and the instants they came at
        self.replay = read_record(self.args["replay"]) if self.args.get("replay") else None
        self._rows: list[dict] = []      # record lines not yet written
        self._record: Path | None = None
        self._drawn: tuple[int, list] = (0, [])
        self._subs: tuple[int, dict] = (-1, {})

    # ---- the loop ----------------------------------------------------------------------------------------------
    def step(self, exp: ServerPort, rnd: int) -> dict:
        """Deliver arrivals and dispatch clients until the buffer is full, then take server step `rnd`. A step that
        would leave the model as it was (the screen rejected its updates, or kept fewer than min_replies) is not
        taken: a step is a new model version, and staleness counts versions. The loop collects again instead, so a
        fast client whose every update is rejected costs the run its own data, not the steps it would have taken
        (docs/async.md); the step that follows reports how many were not taken (`not_taken`) and their rejections."""
        rejected, not_taken = {}, 0
        while True:
            while len(self.buffer) < self.args["buffer"]:
                self._fill(exp)
                arrivals = self._arrivals(exp)
                self.instant += bool(arrivals)
                for f in arrivals:
                    f.instant = self.instant
                    self._deliver(exp, f)
            stats = self._apply(exp, rnd)
            if not stats.get("skipped"):
                break
            rejected.update(stats.get("rejected", {}))
            not_taken += 1
            if not_taken * self.args["buffer"] > 3 * exp.cfg.num_clients:   # every client had its chances
                raise UserError(f"{self.kind}: {not_taken} server steps in a row left the model unchanged (every "
                                f"update rejected, or fewer accepted than min_replies={exp.cfg.min_replies}); "
                                "nothing can train")
        if not_taken:
            stats.update(rejected={**rejected, **stats.get("rejected", {})}, not_taken=not_taken)
        return stats

    def _arrivals(self, exp: ServerPort) -> list[Flight]:
        """The flights that arrive next, together, in order (removed from `flight`; `now` moved to their time):
        on the simulated clock, every flight due first (ties in dispatch order); replaying, the recorded next."""
        if self.replay is not None:
            return self._replayed()
        if not self.flight:   # nobody could be sent: wait for someone to come online
            t = exp.clock.next_online(self.now)
            if math.isinf(t):
                raise UserError("population: no client is online again after simulated time "
                                f"{self.now:.1f}s; nothing can train")
            self.now = max(t, self.now)
            return []
        self.now = self.flight[0].arrival
        out = []
        while self.flight and self.flight[0].arrival == self.now:
            out.append(heapq.heappop(self.flight))
        return out

    def _replayed(self) -> list[Flight]:
        """The flights the record says arrived next, at one instant; a one-line UserError where this run did not
        send them."""
        rows, i = self.replay, self.arrived
        if i >= len(rows):
            raise UserError(f"schedule_args.replay: the record ends after {len(rows)} arrivals; this run "
                            "needs more (fewer rounds, or the record of a longer run)")
        n = 1
        while i + n < len(rows) and "instant" in rows[i] and rows[i + n].get("instant") == rows[i]["instant"]:
            n += 1
        return [self._take(row) for row in rows[i:i + n]]

    def _take(self, row: dict) -> Flight:
        f = next((f for f in self.flight if f.seq == row["seq"]), None)
        if f is None or f.client != row["client"]:
            raise UserError(f"schedule_args.replay: arrival {row['arrival']} is dispatch {row['seq']} (client "
                            f"{row['client']}), which this run has not sent; the record is of another config")
        self.flight.remove(f)
        heapq.heapify(self.flight)
        f.arrival = float(row.get(self.TIME, row.get("wall_time", self.now)))   # the recorded time
        self.now = max(self.now, f.arrival)
        if row.get("failed") or row.get("lost"):   # its update never came: dropped, as it was
            f.update, f.failed = None, str(row.get("failed") or "lost")
        return f

    def _deliver(self, exp: ServerPort, f: Flight) -> None:
        """An arrival: into the buffer (attacked, simulation only), or dropped and recorded."""
        self.arrived += 1
        f.order = self.arrived
        if f.lost:
            self.lost.append(f.client)
            if len(self.lost) > 100 * exp.cfg.num_clients:   # else the loop would never end
                raise UserError("population: clients keep going offline before their updates arrive "
                                f"({len(self.lost)} lost since the last server step); lengthen "
                                "population.online or shorten the clients' times")
            self._note(exp, f, exp.round + 1, lost=True)
        elif f.failed is not None:
            self.failed.append(f.client)
            if len(self.failed) > 100 * exp.cfg.num_clients:
                raise UserError(f"every update fails ({len(self.failed)} since the last server step; the last: "
                                f"{f.failed}); nothing can train")
            self._note(exp, f, exp.round + 1, failed=f.failed)
        else:   # the attack, per arrival (simulation only)
            f.update = exp.receive(f.update, {}, f.draw)
            self.buffer.append(f)

    def _candidate(self, exp: ServerPort):
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

    def _fill(self, exp: ServerPort) -> None:
        """Dispatch clients into the free slots at `now`, each on the current model (`_launch`)."""
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
            arrival, lost = self._dispatch(exp, c, lvl.index)
            sent.append(Flight(arrival, self.seq, c, lvl.index, draw, version, lost))
            self.seq += 1
        trainees = [f for f in sent if not f.lost]
        if self._subs[0] != version:
            self._subs = (version, {})
        subs = self._subs[1]
        need = {exp.levels[f.level] for f in trainees} - subs.keys()
        subs.update(exp.submodels(need, version + 1) if need else {})
        self._launch(exp, trainees, subs)
        for f in sent:
            heapq.heappush(self.flight, f)

    def _dispatch(self, exp: ServerPort, client: int, level: int) -> tuple[float, bool]:
        """(when a client sent now arrives, whether it is lost on the way): the simulated clock's."""
        return exp.clock.dispatch(client, level, self.now)

    def _launch(self, exp: ServerPort, trainees: list[Flight], subs: dict) -> None:
        """Train the dispatched clients now, on the current model: each flight holds its update until it arrives."""
        stripped: dict[int, Submodel] = {}
        for draw, group, picked in by_draw(exp, trainees):   # the runner trains one round's batches at a time
            result = exp.runner.train(exp, draw, picked, {lv: subs[lv] for _, lv in picked})
            by_client = {u.client: u for u in result.updates}
            for f in group:
                u = by_client[f.client]
                f.update = dataclasses.replace(u, sub=credited(u.sub or subs[exp.levels[f.level]], stripped))

    def _apply(self, exp: ServerPort, rnd: int) -> dict:
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
        for f, t in zip(batch, taus):
            self._note(exp, f, rnd, staleness=t, **({"too_stale": True} if bound is not None and t > bound else {}))
        events = dict(zip(TOTALS, (self.lost, self.failed, self.skipped, stale)))   # only the non-empty reported
        for key, v in events.items():
            self.totals[key] += v if isinstance(v, int) else len(v)
        extra = {self.TIME: self.now, "staleness": taus, "level_updates": shares, "in_flight": len(self.flight),
                 **self._stats(), **{k: v for k, v in events.items() if v}, "totals": dict(self.totals)}
        self.lost, self.failed, self.skipped = [], [], 0
        self._write(exp)
        return exp.serve(rnd, updates, {}, extra, step_size)

    def _stats(self) -> dict:
        """A runner's own figures for the step's metrics line (Flower's: nodes refused or moved)."""
        return {}

    # ---- the arrival record (RECORD) ---------------------------------------------------------------------------
    def _note(self, exp: ServerPort, f: Flight, rnd: int, **fields) -> None:
        self._rows.append({"arrival": f.order, "instant": f.instant, "seq": f.seq, "client": f.client,
                           "level": exp.levels[f.level].name, "draw": f.draw, "version": f.version,
                           self.TIME: f.arrival, "step": rnd, **fields})

    def _write(self, exp: ServerPort) -> None:
        """Append this step's lines to the run folder's record. The first time, lines of steps after the one the
        run starts from (a resumed run's, written after its checkpoint) are dropped."""
        if self._record is None:
            self._record = Path(exp.cfg.out) / RECORD
            kept = lines_up_to(self._record, "step", exp.round)
            self._record.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self._record, lambda p: p.write_text("".join(ln + "\n" for ln in kept)))
        with open(self._record, "a") as out:
            out.write("".join(json.dumps(r) + "\n" for r in sorted(self._rows, key=lambda r: r["arrival"])))
        self._rows = []

    # ---- state: plain data (fedlase/checkpoint.py) ----------------------------------------------------------
    def state_dict(self) -> dict:
        subs: dict[int, int] = {}
        table = []

        def plain(f: Flight) -> dict:
            out = {k: getattr(f, k) for k in ("arrival", "seq", "client", "level", "draw", "version", "lost",
                                              "order", "instant")}
            if f.update is not None:
                u = f.update
                if id(u.sub) not in subs:
                    subs[id(u.sub)] = len(table)
                    table.append({"masks": u.sub.masks, "slices": u.sub.slices})
                out.update(delta=u.delta, loss=u.loss, sub=subs[id(u.sub)])
            return out
        return {"now": self.now, "seq": self.seq, "draw": self.draw, "pos": self.pos, "lost": list(self.lost),
                "failed": list(self.failed), "arrived": self.arrived, "instant": self.instant,
                "skipped": self.skipped, "totals": dict(self.totals),
                "flight": [plain(f) for f in sorted(self.flight)], "buffer": [plain(f) for f in self.buffer],
                "subs": table}

    def load_state_dict(self, state: dict, exp: ServerPort, Update) -> None:
        """Back from `state_dict`; `Update`: the engine's (fedlase/engine.py, which imports this module)."""
        dev = exp.device
        table = [Submodel(masks={k: v.to(dev) for k, v in s["masks"].items()},
                          slices={k: tuple(None if i is None else i.to(dev) for i in v)
                                  for k, v in s["slices"].items()}) for s in state["subs"]]

        def flight(d: dict) -> Flight:
            f = Flight(*(d[k] for k in ("arrival", "seq", "client", "level", "draw", "version", "lost")),
                       order=d.get("order", 0), instant=d.get("instant", 0))
            if "delta" in d:
                f.update = Update(f.client, exp.levels[f.level], {k: v.to(dev) for k, v in d["delta"].items()},
                                  d["loss"], table[d["sub"]])
            return f
        self.now, self.seq, self.draw, self.pos = state["now"], state["seq"], state["draw"], state["pos"]
        self.lost, self.skipped = list(state["lost"]), state["skipped"]
        self.failed, self.arrived = list(state.get("failed", [])), state.get("arrived", 0)
        self.instant = state.get("instant", 0)
        self.totals = {**dict.fromkeys(TOTALS, 0), **state.get("totals", {})}
        self.flight = [flight(d) for d in state["flight"]]
        heapq.heapify(self.flight)
        self.buffer = [flight(d) for d in state["buffer"]]
        self._drawn, self._subs = (0, []), (-1, {})

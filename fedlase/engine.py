"""The engine: one round loop for every way of training a round.

A run is plain parts built once from its validated config (`build_parts`: data, client splits, model, method,
client trainer, evaluation data, server step), which the round loop (`Experiment`) takes. A round: sample
clients -> (with a simulated clock, handed in by the caller) who makes the deadline -> each level's submodel
(once per level) -> the round runner trains the clients (one after another, in vmapped groups, or on Flower
nodes) -> the server step on the updates it returns (fedlase/server_step.py: attack, screen, rule) -> trackers ->
(every eval_every rounds) evaluation per resource level. The loop, the server step and the tracker calls exist
once, here; a runner only turns (clients, submodels, global model) into updates. Under schedule=fedbuff or
fedasync the event loop of fedlase/asynchronous.py takes the round's place (who trains when, on the simulated
clock) and ends each server step in the same `serve`. The engine knows no method, dataset, model, rule or
analysis by name: it builds them through fedlase.registry."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from . import checkpoint, determinism
from .aggregate import channel_owners
from .client import ClientSettings, ClientTrainer, build_model_for, client_splits, pick_device
from .config import Config, checked, config_from_dict, parse_override, set_dotted, tagged
from .errors import UserError
from .evaluate import EvalData, EvalSettings, evaluate_levels
from .levels import Level
from .machine import apply_threads
from .masks import Submodel
from .model_facts import ModelFacts, frozen_fingerprint
from .privacy import stages_for
from .registry import METHODS, TRACKERS, check_analysis, load_dataset
from .resources import check_loaded
from .run_dir import EvalCadence, Progress, RunFolder
from .sampling import Sampling, sample_clients
from .server_step import ServerStep
from .train import trainable

log = logging.getLogger("fedlase")

BN_RECOMPUTE_SAMPLES = 5000   # training samples used to recompute static BN statistics before evaluation

__all__ = ["Experiment", "Parts", "build_parts", "Clock", "RunState", "Update", "RoundResult", "RoundRunner",
           "SequentialRounds", "BatchedRounds", "run_experiment", "evaluate_run"]


# ---- state and rounds ----------------------------------------------------------------------------------------
@dataclass
class RunState:
    """Everything a run changes as it goes, besides the method's and trackers' own state."""
    round: int
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    train_time: float = 0.0


@dataclass
class Update:
    """One client's contribution to a round."""
    client: int
    level: Level
    delta: dict[str, torch.Tensor]
    loss: float
    sub: Submodel | None = None   # the client's own submodel where it differs from its level's (label_split)
    weight: float = 1.0           # room for a staleness-weighted server step: 1 unless a `weighted` rule reads it


@dataclass
class RoundResult:
    updates: list[Update]                       # the accepted updates, in client order
    stats: dict = field(default_factory=dict)   # runner-specific figures for the metrics line


class RunnerPort(Protocol):
    """What a round runner may read of the run (the engine's `Experiment` is one): the config, the client trainer,
    the global model's parameters and buffers, the server step (whose checks a Flower runner applies to the
    nodes' replies), and the fingerprint of a frozen base (a LoRA run's; None: nothing frozen)."""
    cfg: Config
    trainer: Any
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    server: Any
    frozen: dict | None   # the frozen base's fingerprint (model_facts.fingerprint), which a Flower node checks


class RoundRunner(Protocol):
    """Trains one round's clients. The engine aggregates what it returns."""
    def train(self, exp: RunnerPort, rnd: int, picked: list[tuple[int, Level]],
              subs: dict[Level, Submodel]) -> RoundResult: ...

    def async_schedule(self, cfg: Config): ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class SequentialRounds:
    """The plain runner: the round's clients train one after another."""

    def async_schedule(self, cfg: Config):
        """The event loop of schedule=fedbuff/fedasync on the clock (fedlase/asynchronous.py); a runner whose
        clients reply on their own (Flower's nodes: fedlase/flower/buffered.py) returns its own."""
        from .asynchronous import AsyncSchedule
        return AsyncSchedule(cfg)

    def train(self, exp: RunnerPort, rnd, picked, subs):
        updates = []
        for client, lvl in picked:
            sub = exp.trainer.submodel(client, subs[lvl], exp.params)
            # a slice's delta stays small: the aggregator adds it into its block
            delta, loss = exp.trainer.update(client, exp.params, exp.buffers, sub, rnd, scatter=False)
            updates.append(Update(client, lvl, delta, loss, sub if sub is not subs[lvl] else None))
        return RoundResult(updates)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class BatchedRounds(SequentialRounds):
    """The round's clients train together in vmapped groups (fedlase/batched.py); equal up to float rounding."""

    def train(self, exp: RunnerPort, rnd, picked, subs):
        from .batched import train_clients_batched  # torch.func.vmap machinery, loaded only when used
        own = [exp.trainer.submodel(client, subs[lvl], exp.params) for client, lvl in picked]   # as sequential
        results = train_clients_batched(exp.trainer, exp.params, exp.buffers, picked, own, rnd)
        return RoundResult([Update(c, lvl, d, loss, sub if sub is not subs[lvl] else None)
                            for (c, lvl), sub, (d, loss) in zip(picked, own, results)])


def trains_batched(cfg: Config, parts: Parts) -> bool:
    """Whether the embedded rounds train batched: `batched_clients=true`, or `auto` on CUDA when neither the config
    (`batching_refused`) nor the model (dropout) rules it out; on a CPU batching does not pay (docs/benchmarks.md)."""
    if cfg.batched_clients == "auto":
        from .batched import dropout_refused
        from .method_config import batching_refused
        return parts.device.type == "cuda" and batching_refused(cfg) is None and dropout_refused(parts.model) is None
    return cfg.batched_clients == "true"


# ---- the parts ------------------------------------------------------------------------------------------------
@dataclass
class Parts:
    """What a run is made of, built once from a validated config (`build_parts`). The round loop (`Experiment`)
    takes them; so do, without any round loop, the cost tables (fedlase/cost.py), the simulated clock
    (fedlase/simtime.py) and the memory measurement (fedlase/measure.py)."""
    device: torch.device
    data: Any                                   # the loaded fedlase.data.Dataset (CPU tensors)
    x_train: torch.Tensor                       # the data on the run's device
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    client_train: list                          # each client's training indices (the partition)
    client_test: list                           # and local test indices
    model: torch.nn.Module
    facts: ModelFacts                           # what fedlase knows of the model (fedlase/model_facts.py)
    method: Any                                 # the fedlase.methods.base.Method (through the registry)
    trainer: ClientTrainer
    levels: tuple[Level, ...]
    level_clients: dict[Level, list[int]]       # who is evaluated (and costed) at each level
    sampling: Sampling
    eval_data: EvalData
    eval_settings: EvalSettings
    server: ServerStep


def build_parts(cfg: Config) -> Parts:
    """Data, client splits, model, method, client trainer, evaluation data and server step of a validated config
    (the order is part of the result: the model is built from the run's seed before the method)."""
    cfg = checked(cfg)   # a Config that `validate` did not make is checked here, before anything is built
    determinism.apply(cfg.deterministic)   # before anything touches CUDA (fedlase/determinism.py)
    device = pick_device(cfg.device)
    apply_threads(cfg.threads)   # 0: the CPUs this process may use (fedlase/resources.py)
    d = load_dataset(cfg)   # the dataset as the task reads it (task=lm: blocks of its documents)
    check_loaded(cfg, d)   # clients and batch_size against the samples, before anything trains
    x_train, y_train = d.x_train.to(device), d.y_train.to(device)
    x_test, y_test = d.x_test.to(device), d.y_test.to(device)
    client_train, client_test = client_splits(cfg, d.y_train.numpy(), d.y_test.numpy(), d.num_classes)
    model = build_model_for(cfg, d).to(device)
    facts = ModelFacts.of(model, d)   # kept beside the model, never on it; traced only if a width method asks
    system = cfg.levels
    method = METHODS.get(cfg.method).build(model, system, facts, run_seed=cfg.seed, **cfg.method_args)
    method.bind_data(d.y_train, client_train, d.num_classes)   # what clients tell the server (RecipFL's histograms)
    trainer = ClientTrainer(ClientSettings.from_config(cfg), model, x_train, y_train,
                            {c: torch.as_tensor(i, device=device) for c, i in enumerate(client_train)}, d.augment)
    g = torch.Generator().manual_seed(cfg.seed)
    bn_sample = torch.randperm(len(d.y_train), generator=g)[:BN_RECOMPUTE_SAMPLES].to(device)
    eval_data = EvalData(x_test, y_test, [torch.as_tensor(i, device=device) for i in client_test], x_train,
                         bn_sample, trainer.classes, y_train, list(trainer.train_idx.values()))
    # who is evaluated at each level: unless the assignment is fixed a client has no fixed level, so every
    # client is evaluated at every level
    owner = system.client_level
    level_clients = {lvl: [c for c in range(cfg.num_clients) if cfg.assignment != "fixed" or owner[c] == lvl.index]
                     for lvl in system.levels}
    coverage = cfg.coverage or method.coverage
    owners = channel_owners(model, facts) if coverage == "kept" else None
    plan = Sampling.from_config(cfg)
    stages = stages_for(cfg, method, plan, method.aggregation, coverage, owners, device)   # dp (fedlase/privacy.py)
    server = ServerStep.of(cfg.robust, cfg.robust_args, cfg.attack, cfg.attack_args, system, cfg.seed,
                           method.aggregation, coverage, owners, stages, method, running=cfg.schedule != "sync")
    return Parts(device, d, x_train, y_train, x_test, y_test, client_train, client_test, model, facts, method,
                 trainer, system.levels, level_clients, plan, eval_data, EvalSettings.from_config(cfg), server)


class Clock(Protocol):
    """Simulated time (fedlase/simtime.py's SimClock), built by the caller and handed in: the engine imports
    nothing that builds on it."""
    def admit(self, picked: list[tuple[int, Level]], rnd: int) -> tuple[list[tuple[int, Level]], dict]:
        """(the clients that train, the round's metrics fields)."""

    def elapsed(self, rnd: int) -> float:
        """Simulated seconds at the end of round `rnd` (a synchronous run's `sim_time`)."""

    def record(self) -> dict:
        """What recomputes the run's simulated time without its data (written to sim.json)."""


# ---- the experiment --------------------------------------------------------------------------------------------
class RunView:
    """A run as its trackers see it (fedlase/analysis.py): the config, device, levels, method, model and test
    images, and the global model as it is now. Its members have no setters, so a tracker cannot replace what the
    run holds; but they are the run's own objects, not copies (the model, the method, the global parameters' dict),
    so a tracker must not change them in place: the built-in ones only read them."""

    def __init__(self, exp: Experiment):
        self._exp = exp

    cfg = property(lambda self: self._exp.cfg)
    device = property(lambda self: self._exp.device)
    levels = property(lambda self: self._exp.levels)
    method = property(lambda self: self._exp.method)
    model = property(lambda self: self._exp.model)
    x_test = property(lambda self: self._exp.x_test)
    params = property(lambda self: self._exp.params, doc="the global model's parameters now")
    round = property(lambda self: self._exp.round)


class Experiment:
    """One run: its parts (`build_parts`), trackers, state, the runner of its rounds and, if asked for, its
    simulated clock. It is handed its parts and its clock already built; it makes its state (a copy of the
    trainable parameters and the buffers), its trackers, its runner unless given one and, off `schedule=sync`,
    the runner's schedule, and starts no process. `from_config` builds the parts and the clock from a config."""

    def __init__(self, cfg: Config, parts: Parts, runner: RoundRunner | None = None, clock: Clock | None = None):
        self.cfg = cfg
        p = parts
        self.device, self.data, self.model, self.method, self.trainer = p.device, p.data, p.model, p.method, p.trainer
        self.x_train, self.y_train, self.x_test, self.y_test = p.x_train, p.y_train, p.x_test, p.y_test
        self.client_train = p.client_train
        self.levels, self.level_clients, self.sampling = p.levels, p.level_clients, p.sampling
        self.eval_data, self.eval_settings, self.server = p.eval_data, p.eval_settings, p.server
        self.coverage, self.owners = p.server.coverage, p.server.owners
        # the trainable parameters only: a frozen base (a LoRA run's) stays in the module, once per process
        self.state = RunState(0, {k: v.detach().clone() for k, v in trainable(self.model).items()},
                              {k: v.detach().clone() for k, v in self.model.named_buffers()})
        self.frozen = frozen_fingerprint(self.model)   # what a checkpoint names the frozen base by (None: none)
        view = RunView(self)   # what a tracker may read: a few of the run's members, none it may replace
        self.trackers = [TRACKERS.get(name)(view, opts) for name, opts in check_analysis(cfg.analysis).items()]
        self.runner = runner or (BatchedRounds() if trains_batched(cfg, p) else SequentialRounds())
        self._broken = False
        self.clock = clock
        # fedbuff/fedasync: the event loop on the clock (fedlase/asynchronous.py), or the runner's own (Flower's
        # steps on its nodes' replies: fedlase/flower/buffered.py); sync: run_round
        self.schedule = None
        if cfg.schedule != "sync":
            self.schedule = self.runner.async_schedule(cfg)

    @classmethod
    def from_config(cls, cfg: Config, runner: RoundRunner | None = None,
                    clock_for: Callable[[Config, Parts], Clock | None] | None = None) -> Experiment:
        """The run of a validated config: its parts (`build_parts`), then its clock from `clock_for(cfg, parts)`
        (fedlase.simtime.clock_for, which may measure memory in child processes; None: no clock)."""
        cfg = checked(cfg)
        parts = build_parts(cfg)
        return cls(cfg, parts, runner, clock_for(cfg, parts) if clock_for is not None else None)

    # the global model, as trackers and runners read it
    @property
    def params(self) -> dict[str, torch.Tensor]:
        return self.state.params

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        return self.state.buffers

    @property
    def round(self) -> int:
        return self.state.round

    def sample(self, rnd: int) -> list[tuple[int, Level]]:
        return sample_clients(self.sampling, rnd)

    def submodels(self, levels, rnd: int) -> dict[Level, Submodel]:
        """Each level's submodel, computed once per round and shared by all clients of that level."""
        return {lvl: self.method.submodel(self.state.params, lvl, rnd).to(self.device)
                for lvl in sorted(set(levels), key=lambda lv: lv.index)}

    def receive(self, u: Update, subs, rnd: int) -> Update:
        """An update as the server receives it (`attack`, fedlase/server_step.py). Applied here, after any runner,
        so the embedded, batched and Flower paths are attacked alike."""
        return self.server.receive(u, subs, self.state.params, rnd)

    def step(self, rnd: int) -> dict:
        """Server step `rnd`: a synchronous round, or the asynchronous schedule up to its next step."""
        return self.run_round(rnd) if self.schedule is None else self.schedule.step(self, rnd)

    @property
    def sim_time(self) -> float | None:
        """Simulated seconds at the last server step (None without a clock)."""
        if self.clock is None:
            return None
        return self.schedule.now if self.schedule is not None else self.clock.elapsed(self.round)

    def run_round(self, rnd: int) -> dict:
        picked = self.sample(rnd)
        sim = {}
        if self.clock is not None:   # fedlase/simtime.py: drops the clients who would miss a deadline
            picked, sim = self.clock.admit(picked, rnd)
        subs = self.submodels([lvl for _, lvl in picked], rnd)
        result = self.runner.train(self, rnd, picked, subs)
        # the server step (fedlase/server_step.py): simulated attacks, the screen, then the rule makes the new model
        updates = [self.receive(u, subs, rnd) for u in result.updates]
        stats = self.serve(rnd, updates, subs, {**result.stats, **sim})
        if stats.get("skipped"):
            log.warning("round %d: %d updates, fewer than min_replies=%d; global model unchanged",
                        rnd, stats["clients"], self.cfg.min_replies)
        return stats

    def serve(self, rnd: int, updates: list[Update], subs: dict[Level, Submodel], extra: dict,
              step_size: float = 1.0) -> dict:
        """The server step on received (attacked) updates: the screen, then (with enough of them) the stages and
        the rule make the new model, then the trackers; returns the step's metrics fields. `step_size`: the new
        model is old + step_size x (the rule's model - old) (an asynchronous schedule's server learning rate or
        mixing; fedlase/asynchronous.py)."""
        old = self.state.params
        updates, rejected, rms = self.server.screen(updates, subs, old)
        stats = {"train_loss": float(np.mean([u.loss for u in updates])) if updates else float("nan"),
                 "clients": len(updates), **extra}
        if rejected:   # beside the replies a Flower runner rejected already
            stats["rejected"] = {**stats.get("rejected", {}), **rejected}
        if len(updates) >= self.cfg.min_replies and updates:
            self.state.params, info = self.server.new_model(old, updates, subs, rms, rnd)
            if step_size != 1.0:   # 1: the rule's model exactly
                self.state.params = {n: p + step_size * (self.state.params[n] - p) for n, p in old.items()}
            if info:
                stats["robust"] = info
            # kept for every rule: the screen rejects non-finite updates, yet finite ones can still overflow the
            # float32 sum (robust=none lets anything in); one pass over the model, ~0.1% of a demo round
            if not self._broken and not all(bool(torch.isfinite(p).all()) for p in self.state.params.values()):
                self._broken = True   # a result, not a crash: said once
                log.warning("round %d: the global model now holds non-finite values (robust=%s)", rnd,
                            self.server.rule.name)
            # analyses see the clients that were aggregated, and each level's submodel (under an asynchronous
            # schedule, whose updates carry their own: that of the level's last update)
            trained = {u.level: subs.get(u.level) or u.sub for u in updates}
            for t in self.trackers:
                t.on_round(rnd, [(u.client, u.level) for u in updates], trained, old, self.state.params)
        else:   # a synchronous round says so (run_round); an asynchronous schedule collects again
            stats["skipped"] = True
        stats.update(self.server.info(rnd))   # a stage's figures, e.g. dp's epsilon after this round
        return stats

    # ---- evaluation ------------------------------------------------------------------------------------------
    def evaluate(self, rnd: int) -> dict:
        """The evaluation step (`evaluate.evaluate_levels`: per level, global and local accuracy with client
        fairness), then what the trackers add."""
        out = evaluate_levels(self.model, self.method, self.state.params, self.state.buffers, self.level_clients,
                              self.eval_data, self.eval_settings, rnd)
        for t in self.trackers:
            out.update(t.on_eval(rnd) or {})
        return out

    # ---- state -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        s = self.state
        return {"round": s.round, "params": s.params, "buffers": s.buffers, "train_time": s.train_time,
                "method": self.method.state_dict(), "trackers": [t.state_dict() for t in self.trackers],
                "runner": self.runner.state_dict(), "server": self.server.state_dict(), "config": self.cfg.to_dict(),
                **({"schedule": self.schedule.state_dict()} if self.schedule is not None else {}),
                **({"frozen": self.frozen} if self.frozen is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        if state.get("frozen") != self.frozen:   # the checkpoint holds no base: it must be trained on this one
            raise UserError(f"{self.cfg.out}: the checkpoint was trained on another frozen base "
                            f"({state.get('frozen')}) than this run's model ({self.frozen})")
        self.state = RunState(state["round"], {k: v.to(self.device) for k, v in state["params"].items()},
                              {k: v.to(self.device) for k, v in state["buffers"].items()}, state["train_time"])
        self.method.load_state_dict(state["method"])
        for t, s in zip(self.trackers, state["trackers"]):
            t.load_state_dict(s)
        self.runner.load_state_dict(state.get("runner", {}))
        self.server.load_state_dict(state.get("server", {}))
        if self.schedule is not None:   # what is in flight (fedlase/asynchronous.py)
            self.schedule.load_state_dict(state["schedule"], self, Update)


# ---- the run loop ----------------------------------------------------------------------------------------------
def run_experiment(cfg: Config, resume: bool = False, progress: bool = True, runner: RoundRunner | None = None,
                   clock: Callable[[Config, Parts], Clock | None] | None = None) -> dict:
    """Run (or resume) one experiment; write metrics.jsonl, checkpoint.pt and summary.json into cfg.out.
    `runner` trains the rounds (default: sequential, or batched with batched_clients; Flower passes its own).
    `clock(cfg, parts)` builds the simulated clock a config with `device_model` or `deadline` asks for
    (fedlase.simtime.clock_for: fedlase/dispatch.py and Flower's ServerApp hand it in)."""
    cfg = checked(cfg)   # before the run folder is touched
    if clock is None and cfg.simulated:
        raise UserError("device_model/deadline/population/schedule: simulated time needs a clock; run through "
                        "fedlase.run or pass clock=fedlase.simtime.clock_for")
    folder = RunFolder(cfg, resume)
    exp = Experiment.from_config(cfg, runner, clock)
    last = folder.open(exp)   # the last evaluated line (a resumed run's), or None
    cadence, bar = EvalCadence.of(cfg), Progress(cfg, exp.round, progress)
    stopped = None   # why the run ended before `rounds` (a stage's budget: dp.max_epsilon)
    while exp.round < cfg.rounds:
        rnd = exp.round + 1
        if (stopped := exp.server.halt(rnd)) is not None:
            log.warning("%s", stopped)
            break
        t0, before = time.perf_counter(), exp.sim_time
        stats = exp.step(rnd)
        exp.state.train_time += time.perf_counter() - t0
        exp.state.round = rnd
        line = {"round": rnd, **stats, "train_time": exp.state.train_time}
        if cadence.due(rnd, before, exp.sim_time):
            t1 = time.perf_counter()
            line.update(exp.evaluate(rnd), eval_time=time.perf_counter() - t1)
            folder.append(line)
            last = line
            exp.server.evaluated(rnd)   # the screen's rejections since the last evaluation: one line at most
            if "epsilon" in line:   # dp: the privacy spent, in the log too (Flower's ServerApp's)
                log.info("round %d: epsilon %.4g at delta %g", rnd, line["epsilon"], line["dp"]["delta"])
        for t in exp.trackers:
            t.on_metrics(rnd, line)
        if folder.checkpoint_due(rnd):
            folder.save(exp)
        bar.update(time.perf_counter() - t0, line, last)
    bar.close()
    return folder.finish(exp, last, stopped)


# evaluation-only keys: a finished run can be evaluated again under other values of these
EVAL_KEYS = tagged("eval")   # the settings `fedlase evaluate` may change (Options tagged "eval")


def evaluate_run(run_dir, overrides: list[str] = ()) -> dict:
    """Evaluate the model in a run folder's checkpoint again, optionally under other evaluation settings
    (EVAL_KEYS only: anything else would describe another run). Returns the evaluation (as a metrics line)."""
    ckpt = Path(run_dir) / "checkpoint.pt"
    if not ckpt.is_file():
        raise UserError(f"{run_dir}: no checkpoint.pt; a run folder holds one once its first checkpoint is written")
    state = checkpoint.load(ckpt)   # weights-only: nothing in a run folder runs
    raw = dict(state["config"])
    raw["out"] = str(run_dir)   # where the run is now: the folder it was written to may be gone (a copied run)
    given = dict(parse_override(item) for item in overrides)
    for key, value in given.items():
        if key not in EVAL_KEYS and key != "plugins":   # plugins: modules the user chooses to import
            raise UserError(f"{key}: only evaluation settings can change here ({', '.join(EVAL_KEYS)})")
        set_dotted(raw, key, value)
    if "plugins" not in given:   # the run folder's own list imports nothing (fedlase/checkpoint.py)
        checkpoint.check_plugins(ckpt, raw.get("plugins", []), "name them yourself if you trust them: "
                                 f"fedlase evaluate {run_dir} 'plugins=[...]'")
    exp = Experiment.from_config(config_from_dict(raw))
    exp.load_state_dict(state)
    return {"round": exp.round, **exp.evaluate(exp.round)}

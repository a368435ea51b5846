"""The server step: robust aggregation of submodel updates, and simulated faulty or malicious clients.

The engine's round (fedlase/engine.py: `Experiment.run_round`, after the round runner returns) hands the
replies to the run's `ServerStep`, a pipeline of registered parts (`Rule`, `Attack`: classes with their
options, registered in fedlase/registry.py and named by the config):

1. the attack (`attack`, simulation only), per arrival: an attacking client's delta is corrupted as the server
   receives it.
2. the screen (every rule that declares the `screen` option: all built-ins but `none`): an update is rejected,
   with its reason, when a value of its delta or its loss is not finite, or when its norm per coordinate held
   exceeds `robust_args.screen` times its reference: the lower median of that figure (its level's or the
   round's; small figures and near-zero updates left out of it, near-zero ones out of the step too; under an
   asynchronous schedule, a step with fewer than two updates above near zero is judged against the recent
   arrivals: `judge`). docs/methods.md, "Robust aggregation", says why this rule and this bound. Under a stage
   or for a method that may not judge one update by the others (dp; RecipFL, `Method.screen_by_others`), the
   per-update checks only.
3. the stages (`Stage`): a step between the screen and the rule: differential privacy (fedlase/privacy.py,
   under the `dp` key: clip each accepted update, then the public denominator and the noise on the new model).
4. the rule (`robust`) turns the accepted updates into the new global model, per coordinate, under the run's
   `coverage` and aggregation mode (fedlase/aggregate.py). The built-in rules and attacks are in
   fedlase/rules.py; a plug-in module registers its own the same way (docs/library.md, "Adding a rule").
5. the method's own step on the accepted updates (`Method.server_update`, fed by their payloads, the only channel
   from a client to the server): RecipFL's hypernetwork, on the changes its clients trained of their generated
   models; FedDSE's count of its clients' channel choices, for its evaluation submodels; the adapter methods' own
   aggregation (HetLoRA, FlexLoRA, FLoRA: fedlase/llm/lora_methods.py), which replaces the rule's model; nothing
   for the others.

Everything here is deterministic: a client's attack noise is seeded from (run seed, round, client) and the
attacked set from the run seed, so a resumed run equals an uninterrupted one.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from .errors import ConfigError
from .options import Option, check_options
from .registry import ATTACKS, RULES
from .robust_config import WHO

log = logging.getLogger("fedlase")
TOTALS = ("rejected", "clipped", "near_zero")   # the server step's running totals, per level (ServerStep.totals)


# ---- the parts: their base classes -------------------------------------------------------------------------
class Rule:
    """A server rule: turns a round's accepted updates into the new global model (`ServerStep`).

    Subclasses set `name` and `options` (`robust_args.<key>`) and implement `aggregate`. A rule that declares the
    `screen` option (SCREEN) is preceded by the screen; one without it sees every update. `weighted`: whether
    the rule reads `Update.weight` (room for a staleness-weighted step: a buffered server would weight late
    updates); the server step refuses weights other than 1 for a rule that does not."""
    name: ClassVar[str] = ""
    options: ClassVar[dict[str, Option]] = {}
    weighted: ClassVar[bool] = False
    # the rule this one runs as under a stage whose screen_by_others is False (dp), or None: itself
    privately: ClassVar[type[Rule] | None] = None
    # whether its result (as `privately`, if set) moves by at most one clipped update when one client changes, so
    # dp may run with it (fedlase/robust_config.py, check_dp); never inherited: a subclass says so itself
    dp_safe: ClassVar[bool] = False
    # whether it judges a step's updates against each other (a median, a trimmed mean, Krum's neighbours, centered
    # clipping's radius), which a step of one update (fedasync) leaves nothing to do: refused there
    # (fedlase/sim_config.py); the screen's rules judge an arrival against the recent ones instead
    compares: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.dp_safe = bool(vars(cls).get("dp_safe", False))

    def __init__(self, **args):
        self.args = self.check_args(args)

    # each accepted update's reference norm per coordinate held (its level's or the step's: `judge`), set by the
    # screen before `aggregate`; a rule that clips relative to the reference reads it
    refs: list[float] | None = None

    def judge(self, updates: list, subs: dict, params: dict, recent: list | None = None) -> Verdict:
        """The screen (`judge`) when the rule declares its `screen` option, else every update accepted."""
        return judge(updates, subs, params, self.args.get("screen"), recent)

    def screen(self, updates: list, subs: dict, params: dict) -> tuple[list, dict, list[float]]:
        """(accepted, {client: why} of the rejected, norms per coordinate held of the accepted)."""
        v = self.judge(updates, subs, params)
        self.refs = v.refs
        return v.accepted, v.rejected, v.rms

    def state_dict(self) -> dict:
        """What the rule carries from one step to the next (centered clipping's center), checkpointed."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    @classmethod
    def check_args(cls, args) -> dict:
        """robust_args checked for this rule (one-line ConfigError naming the key), defaults filled."""
        return check_options("robust_args", cls.options, args, f"robust={cls.name}")

    def aggregate(self, params: dict, updates: list, subs: dict, rms: list[float], mode: str, coverage: str,
                  owners) -> tuple[dict, dict]:
        """(new global params, what the rule did for the metrics line) from the screened `updates` (each an
        engine `Update`; `subs`: each level's submodel, for updates without one of their own; `rms`: their norms
        per coordinate held), under the aggregation `mode`, `coverage` and `owners` (fedlase/aggregate.py)."""
        raise NotImplementedError


class Attack:
    """A simulated faulty or malicious client (simulation only): `corrupt` turns an attacker's delta into what
    the server receives. Subclasses set `name` and their own `options` (`attack_args.<key>`) and implement
    `corrupt`; the options that say who attacks (fedlase.robust_config.WHO: fraction, level, clients) every
    attack takes from this base (`all_options`), unless it sets `chooses_clients = False` (`none`).
    `clients`: the attackers, drawn from the run's seed."""
    name: ClassVar[str] = ""
    options: ClassVar[dict[str, Option]] = {}
    chooses_clients: ClassVar[bool] = True
    # whether it replaces its updates after seeing the step's honest ones (`collude`), which a step of one update
    # (fedasync, a buffer of one) never holds: refused there (fedlase/sim_config.py), where it would do nothing
    colludes: ClassVar[bool] = False

    def __init__(self, args: dict, system, seed: int):
        self.args, self.seed = args, seed
        self.clients = attackers(self.name, args, system, seed) if self.chooses_clients else frozenset()

    @classmethod
    def all_options(cls) -> dict[str, Option]:
        """The attack's own options, then who attacks (WHO) where it chooses clients."""
        return {**cls.options, **WHO} if cls.chooses_clients else dict(cls.options)

    def corrupt(self, delta: dict, sub, full_shapes: dict, rnd: int, client: int) -> dict:
        """One attacking client's delta as the server receives it (`sub`: its submodel; a delta whose shape
        differs from `full_shapes` is a gathered slice's)."""
        raise NotImplementedError

    def collude(self, updates: list, subs: dict, params: dict) -> list:
        """A server step's received updates with the attackers' replaced after seeing the others' (colluders,
        who know the honest updates of the step); by default unchanged."""
        return updates

    @classmethod
    def check_args(cls, args, system) -> dict:
        """attack_args checked for this attack against the run's `system` (client ids, level names)."""
        out = check_options("attack_args", cls.all_options(), args, f"attack={cls.name}")
        if out.get("clients") is not None:
            if (args or {}).keys() & {"fraction", "level"}:
                raise ConfigError("attack_args.clients", "names the attackers; drop attack_args.fraction/level")
            bad = [c for c in out["clients"] if isinstance(c, bool) or not isinstance(c, int)
                   or not 0 <= c < system.num_clients]
            if bad or not out["clients"]:
                raise ConfigError("attack_args.clients", f"expected client ids in 0..{system.num_clients - 1}, "
                                  f"got {out['clients']!r}")
            twice = sorted({c for c in out["clients"] if out["clients"].count(c) > 1})
            if twice:
                raise ConfigError("attack_args.clients", f"names client {', '.join(map(str, twice))} more than "
                                  f"once ({out['clients']!r}); list each attacker once")
        if out.get("level") is not None and system.find(out["level"]) is None:
            raise ConfigError("attack_args.level", f"{out['level']!r} is not a level of system "
                              f"({', '.join(lv.name for lv in system.levels)})")
        return out


# ---- the attacks -------------------------------------------------------------------------------------------------
def attackers(kind: str, args: dict, system, seed: int) -> frozenset[int]:
    """The attacking clients: the named ones, or round(fraction x pool) (at least one) drawn from the run seed
    among all clients or those of `level` (by client index, as `system` assigns them under fixed assignment)."""
    if kind == "none":
        return frozenset()
    if args["clients"] is not None:
        return frozenset(args["clients"])
    pool = list(range(system.num_clients))
    if args["level"] is not None:
        index = system.find(args["level"]).index
        pool = [c for c in pool if system.client_level[c] == index]
    from .sampling import Stream, derive_seed
    rng = np.random.default_rng(derive_seed(seed, 0, Stream.ATTACK))
    k = max(1, round(args["fraction"] * len(pool)))
    return frozenset(int(c) for c in rng.choice(pool, size=k, replace=False))


# ---- the screen ------------------------------------------------------------------------------------------------
def on_host(values: list[torch.Tensor]) -> list:
    """Scalar tensors as Python numbers, read in one transfer: on a GPU the server step then waits for the device
    once per call, not once per tensor (a ResNet-18 round's screen read ~900 scalars one by one)."""
    return torch.stack([v.to(torch.float64) for v in values]).tolist() if values else []


def held(delta: dict, sub, full: dict) -> int:
    """Coordinates a client holds: its mask's count per masked parameter, the whole size of the others (of a
    tensor of the method's own, not of the global model `full`, such as RecipFL's generated models: its size)."""
    counts = on_host([sub.masks[n].sum() for n in delta if n in sub.masks])
    return sum(int(c) for c in counts) + sum((full[n] if n in full else d).numel()
                                             for n, d in delta.items() if n not in sub.masks)


def squared_norms(deltas: list[dict]) -> list[float]:
    """Each delta's squared L2 norm, summed in float64 (one host transfer for them all)."""
    flat, out = on_host([d.double().square().sum() for delta in deltas for d in delta.values()]), []
    for delta in deltas:
        out.append(sum(flat[:len(delta)]))   # summed in the parameters' order, as one float() each summed before
        flat = flat[len(delta):]
    return out


def changes(delta: dict) -> dict:
    """The tensors of a payload that are changes, which the screen's figures count: the floating ones (RecipFL's
    generated models' included). A method's own tensor of another dtype is a record, not a change (FedDSE's
    channel choice, bool): it holds no NaN and no norm."""
    if all(d.is_floating_point() for d in delta.values()):
        return delta
    return {n: d for n, d in delta.items() if d.is_floating_point()}


def norms(updates: list, subs: dict, full: dict) -> tuple[list[float], list[float]]:
    """Each update's L2 norm and norm per coordinate held (norm / sqrt(held)), of its changes (`changes`), summed in
    float64 so that a float32 delta of 3e38 gives a finite figure; a NaN or Inf anywhere makes both non-finite."""
    sizes: dict[int, int] = {}
    l2, rms = [], []
    deltas = [changes(u.delta) for u in updates]
    for u, delta, ss in zip(updates, deltas, squared_norms(deltas)):
        sub = u.sub or subs[u.level]
        if id(sub) not in sizes:
            sizes[id(sub)] = max(held(delta, sub, full), 1)
        l2.append(math.sqrt(ss) if math.isfinite(ss) else math.inf if ss == math.inf else math.nan)
        rms.append(l2[-1] / math.sqrt(sizes[id(sub)]))
    return l2, rms


def low_median(values: list[float]) -> float:
    """The lower median (of two middle values, the smaller): with two updates, one absurd, the honest one."""
    s = sorted(values)
    return s[(len(s) - 1) // 2] if s else math.nan


def up_median(values: list[float]) -> float:
    """The upper median (of two middle values, the larger): with half the updates zero, an honest one."""
    s = sorted(values)
    return s[len(s) // 2] if s else math.nan


# near zero: a norm per coordinate held at most 1/K^3 of the reference of the figures it is judged among, K the
# screen's factor (`near_zero_cut`; 1/27 under `bounded`): x1e-2 of any update the screen takes (at most K times
# the reference) falls under it, while honest updates were never under 1/20 of their reference in any measured run
# (level 1's in the CNN regime's system come nearest). A figure alone, with nothing to be judged among (the
# first arrival of an asynchronous run), is near zero at most NEAR_ZERO_MODEL of the global model's own.
NEAR_ZERO_MODEL = 1e-6
PER_LEVEL = 3      # a level's own reference needs the figures of at least this many of its clients
ALARM = 0.2       # a share of a level's updates rejected since the last evaluation that honest runs do not show
RECENT = 20        # a schedule's running reference: the figures of the last RECENT arrivals (ServerStep.recent)


def level_key(u) -> str:
    """An update's level as the screen's references and the totals name it ("-": an update without a level)."""
    return u.level.name if u.level is not None else "-"


@dataclass
class Verdict:
    """What the screen (`judge`) found on a step's updates."""
    accepted: list          # the accepted updates
    rejected: dict          # {client id as str: why} of the rejected
    rms: list[float]        # the accepted updates' norms per coordinate held
    refs: list[float]       # the accepted updates' references for a clip (over the figures the screen kept)
    near_zero: list         # the near-zero updates' clients (left out of the step and the references)
    solid: list             # (level, client, norm per coordinate) of the finite updates not near zero


def judge(updates: list, subs: dict, full: dict, factor: float | None, recent: list | None = None,
          near_zero: bool = True) -> Verdict:
    """The screen. An update is rejected when a value of its delta or its loss is not finite, or when its norm
    per coordinate held exceeds `factor` times its reference. factor None: no screen at all (robust=none).

    The reference (`reference`) is the lower median of the norms per coordinate held of the figures that are
    neither non-finite, nor near zero, nor more than `factor` times below the step's upper median: small updates
    cannot do harm by being taken, only by pulling the reference down, so that a minority of them would get the
    honest updates clipped or rejected. Near zero (1/factor^3 of the reference of all the finite figures; a free
    rider's zero or x1e-12 update): left out of the step as if its client had not replied (averaged in, it would
    only shrink the others' step: five free riders in ten halve it) and reported, not rejected; a step of nothing
    but near-zero updates takes none. `near_zero` False (dp, whose
    denominator is public): no update is near zero. A level with the figures of at least PER_LEVEL clients has its
    own reference (a small level's updates differ in scale from a large one's; at most the larger of the step's
    upper median and the level's lower third, so that fewer than two thirds of a level cannot lift it); the
    others take the step's. A figure beyond `factor`
    x the step's reference counts towards no level's, so that an absurd client neither makes nor moves its
    level's. `recent` (a schedule's running reference, None in synchronous rounds): in a step of fewer than two
    finite updates above near zero (fedasync, a small buffer, a buffer of zeros and one update), the (level,
    client, figure) of the last arrivals join it, one figure per client (its latest), so that it is judged
    against the others; until two clients' figures are known it cannot be judged, and is rejected. A step of two
    or more judges its own, as a synchronous round does (the lower median of two is the smaller)."""
    _, rms = norms(updates, subs, full)
    n = len(updates)
    if factor is None:
        return Verdict(list(updates), {}, rms, [math.nan] * n, [], [])
    rejected, keep = {}, []
    for i, u in enumerate(updates):
        if not math.isfinite(u.loss):
            rejected[str(u.client)] = f"non-finite loss ({u.loss})"
        elif not math.isfinite(rms[i]):
            rejected[str(u.client)] = "non-finite value in its update"
        else:
            keep.append(i)
    model = math.sqrt(squared_norms([full])[0] / max(sum(p.numel() for p in full.values()), 1))
    own = {updates[i].client: (level_key(updates[i]), rms[i]) for i in keep}
    tiny = near_zero_cut(own, factor, model) if near_zero else -math.inf
    running = recent is not None and sum(r > tiny for _, r in own.values()) < 2
    latest = own
    if running:   # one figure per client: its latest
        latest = {**{c: (lv, r) for lv, c, r in recent}, **own}
        tiny = near_zero_cut(latest, factor, model) if near_zero else -math.inf
    solid = {c: (lv, r) for c, (lv, r) in latest.items() if r > tiny}
    step_ref, level_ref = references(solid, factor)
    accepted, near = [], []
    for i in keep:
        u = updates[i]
        ref = level_ref.get(level_key(u), step_ref)
        if rms[i] <= tiny:
            near.append(u.client)
            continue
        elif running and len(solid) < 2:
            rejected[str(u.client)] = "no reference yet: the first arrival is judged by the ones after it"
            continue
        elif ref > 0 and rms[i] > factor * ref:
            rejected[str(u.client)] = (f"update norm per coordinate {rms[i]:.3g} is {rms[i] / ref:.3g}x "
                                       f"the median {ref:.3g} (limit {factor:g}x)")
            continue
        accepted.append(i)
    # the clip's references: the same, over the figures the screen kept (a rejected update sets no bound)
    kept = {c: x for c, x in solid.items() if str(c) not in rejected}
    step_kept, level_kept = references(kept, factor)
    refs = [level_kept.get(level_key(updates[i]), step_kept) for i in accepted]
    for c, why in rejected.items():   # routine: said once per evaluation (ServerStep.evaluated)
        log.debug("rejected client %s's update: %s", c, why)
    solid_now = [(level_key(updates[i]), updates[i].client, rms[i]) for i in keep if rms[i] > tiny]
    return Verdict([updates[i] for i in accepted], rejected, [rms[i] for i in accepted], refs, near, solid_now)


def near_zero_cut(figures: dict, factor: float, model: float) -> float:
    """The norm per coordinate held at or below which a figure of {client: (level, figure)} is near zero:
    1/factor^3 of their `reference`, or, for a figure alone, NEAR_ZERO_MODEL of the model's own (`model`)."""
    values = [r for _, r in figures.values()]
    return reference(values, factor) / factor ** 3 if len(values) >= 2 else NEAR_ZERO_MODEL * model


def counted_from(values: list[float], factor: float) -> float:
    """The smallest figure of `values` that counts towards their reference: 1/`factor` of their upper median.
    Small figures are left out of it, as the screen rejects large ones, so that shrunken updates (a free
    rider's, a wrong learning rate's) cannot lower it under the honest updates, down to their exact half. Where
    that half is fewer than PER_LEVEL figures (of two updates, the larger one), the norms cannot say which side is
    wrong, and every figure counts (the lower median of all: the side that cannot break the model)."""
    low = up_median(values) / factor
    big = sum(v >= low for v in values)
    return -math.inf if 2 * big == len(values) and big < PER_LEVEL else low


def counting(values: list[float], factor: float) -> list[float]:
    """The figures of `values` that count towards their reference (`counted_from`)."""
    low = counted_from(values, factor)
    return [v for v in values if v >= low]


def reference(values: list[float], factor: float) -> float:
    """The figure `values` are judged against: the lower median of those that count (`counting`)."""
    return low_median(counting(values, factor))


def low_third(values: list[float]) -> float:
    """The figure a third of the way up (rank floor((n - 1) / 3)): of three, the smallest."""
    s = sorted(values)
    return s[(len(s) - 1) // 3] if s else math.nan


def references(figures: dict, factor: float) -> tuple[float, dict[str, float]]:
    """(the `reference` of the figures {client: (level, figure)}, {level: its own} for the levels with PER_LEVEL or
    more clients' figures). A level's own is its `reference`, but no higher than the larger of the step's upper
    median and the level's lower third: fewer than two thirds of a level's clients cannot lift it beyond the
    step's own spread (two of three, sending 2.5x, would set the lower median). A figure that does not count
    towards the step's (`counted_from`: too small) or lies beyond `factor` x it counts towards no level's:
    neither shrunken nor absurd updates make or move a level's."""
    values = [r for _, r in figures.values()]
    low = counted_from(values, factor) if values else -math.inf
    counted = [v for v in values if v >= low]
    step = low_median(counted) if values else math.nan
    up = up_median(counted)   # the step's own upper median (of the figures that count)
    by_level: dict[str, list[float]] = {}
    for lv, r in figures.values():
        if r >= low and (not step > 0 or r <= factor * step):
            by_level.setdefault(lv, []).append(r)
    own = {lv: counting(rs, factor) for lv, rs in by_level.items() if len(rs) >= PER_LEVEL}
    return step, {lv: min(low_median(c), max(up, low_third(c))) for lv, c in own.items()}


def screen(updates: list, subs: dict, full: dict, factor: float | None) -> tuple[list, dict, list[float]]:
    """(accepted updates, {client id as str: reason} of the rejected, the accepted updates' norms per coordinate):
    `judge` on a synchronous round. factor None: no screen at all (robust=none)."""
    v = judge(updates, subs, full, factor)
    return v.accepted, v.rejected, v.rms


def of_model(updates: list, params: dict) -> list:
    """The updates as the rule aggregates them (and an attack corrupts them): their tensors of the global model
    `params`. A payload may also hold tensors of the method's own (RecipFL's: the change of each generated model;
    FedDSE's: the client's channel choice), which only its `server_update` reads; the screen judges the whole
    payload (its changes: `changes`)."""
    if all(n in params for u in updates for n in u.delta):
        return updates
    return [dataclasses.replace(u, delta={n: d for n, d in u.delta.items() if n in params}) for u in updates]


def with_own(updates: list, payloads: list, params: dict) -> list:
    """`updates` (of the model: `of_model`) with the method's own tensors of `payloads` (the updates they were
    cut from, in the same order) put back, as they were."""
    return [u if u.delta.keys() >= p.delta.keys() else
            dataclasses.replace(u, delta={**u.delta, **{n: d for n, d in p.delta.items() if n not in params}})
            for u, p in zip(updates, payloads)]


def make_rule(rule: str | None = None, args: dict | None = None) -> Rule:
    """The registered rule `rule` (default: the config's default, `robust`) with its `robust_args` checked
    (library code and checks that call a rule on updates of their own)."""
    if rule is None:
        from .config import Config  # the one place the default is written
        rule = Config.__dataclass_fields__["robust"].default
    return RULES.get(rule)(**(args or {}))


# ---- the pipeline ------------------------------------------------------------------------------------------------
class Stage:
    """A step between the screen and the rule: differential privacy (fedlase/privacy.py: `updates` clips each
    accepted update, `model` adds the noise to the new model). Both default to passing things through; a stage
    seeds its own draws from (run seed, round) under a stream tag of its own. `info` adds to the round's metrics
    line, `halt` may end the run before a round (a privacy budget), and a stage's state is checkpointed.
    `screen_by_others` False: the screen must not reject one update for what the others are (its median bound),
    only for what it is itself (non-finite)."""
    screen_by_others: ClassVar[bool] = True

    def updates(self, updates: list, subs: dict, params: dict, rnd: int) -> list:
        return updates

    def model(self, old: dict, new: dict, rnd: int) -> dict:
        return new

    def info(self, rnd: int) -> dict:
        return {}

    def halt(self, rnd: int) -> str | None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@dataclass
class ServerStep:
    """A run's server step: `receive` (the attack, per arrival), then `screen` and `new_model` (the stages, the
    rule, the stages' `model`) on the round's replies. The engine calls them in that order and decides between
    the screen and the rule whether the round has enough replies (min_replies)."""
    rule: Rule
    attack: Attack
    mode: str              # the method's aggregation mode (fedlase/aggregate.py)
    coverage: str
    owners: dict | None    # per-channel credit under coverage=kept
    stages: tuple[Stage, ...] = ()
    method: Any = None     # its `server_update` follows the rule (fedlase/methods/base.py; RecipFL's hypernetwork)
    # a schedule's running reference (fedbuff, fedasync): the screen's figures of the last RECENT arrivals, as
    # (level, client, norm per coordinate held); None in synchronous rounds, whose steps judge their own
    recent: list | None = None
    # running totals over the run, per level: updates rejected, clipped by the rule, and near zero (every
    # metrics line carries them: one is written only at evaluated steps)
    totals: dict = dataclasses.field(default_factory=lambda: {k: {} for k in TOTALS})
    near_zero: list = dataclasses.field(default_factory=list)   # the last step's near-zero updates' clients
    # since the last evaluation, per level: updates screened, and rejected (`evaluated` says it in one line)
    window: dict = dataclasses.field(default_factory=lambda: {"seen": Counter(), "rejected": Counter()})

    @classmethod
    def of(cls, robust: str, robust_args: dict, attack: str, attack_args: dict, system, seed: int, mode: str,
           coverage: str, owners, stages: tuple[Stage, ...] = (), method=None, running: bool = False) -> ServerStep:
        """The registered rule and attack by name, their options checked (the attackers drawn from `seed`). Under
        a stage that may not treat one update by what the others are (dp), a rule that names its `privately` form
        runs as that form, with the options it declares. `running`: keep a running reference over the recent
        arrivals (an asynchronous schedule's steps, down to one update each)."""
        kind = ATTACKS.get(attack)
        rule = RULES.get(robust)(**robust_args)
        if rule.privately is not None and not all(s.screen_by_others for s in stages):
            rule = rule.privately(**{k: v for k, v in rule.args.items() if k in rule.privately.options})
        return cls(rule, kind(kind.check_args(attack_args, system), system, seed), mode, coverage, owners, stages,
                   method, [] if running else None)

    def receive(self, u, subs: dict, params: dict, rnd: int):
        """An update as the server receives it: an attacking client's corrupted (simulation only)."""
        if u.client not in self.attack.clients:
            return u
        shapes = {n: p.shape for n, p in params.items()}
        model = of_model([u], params)[0]   # the attack corrupts the model's update; the method's own pass as sent
        bad = dataclasses.replace(model, delta=self.attack.corrupt(model.delta, u.sub or subs[u.level], shapes, rnd,
                                                                   u.client))
        return with_own([bad], [u], params)[0]

    def own_reply(self, level) -> dict:
        """What a reply of a client of `level` holds beside its delta: its method's tensors (`Method.own_reply`)."""
        return {} if self.method is None else self.method.own_reply(level)

    def screen(self, updates: list, subs: dict, params: dict) -> tuple[list, dict, list[float]]:
        """(accepted updates, {client: why} of the rejected, the accepted ones' norms per coordinate held)."""
        if not self.rule.weighted and any(u.weight != 1.0 for u in updates):
            raise ValueError(f"robust={self.rule.name} does not take weighted updates (its `weighted`)")
        updates = with_own(self.attack.collude(of_model(updates, params), subs, params), updates, params)
        if "screen" in self.rule.args and not self.by_others():
            v = judge(updates, subs, params, math.inf, near_zero=False)   # the per-update checks only (dp, RecipFL)
        else:
            v = self.rule.judge(updates, subs, params, self.recent)
        self.rule.refs, self.near_zero = v.refs, v.near_zero
        if self.recent is not None:
            self.recent = (self.recent + v.solid)[-RECENT:]
        level = {str(u.client): level_key(u) for u in updates}
        self._count("rejected", Counter(level[c] for c in v.rejected))
        self.window["seen"].update(level.values())
        self.window["rejected"].update(level[c] for c in v.rejected)
        self._count("near_zero", Counter(level[str(c)] for c in v.near_zero))
        return v.accepted, v.rejected, v.rms

    def by_others(self) -> bool:
        """Whether the screen may reject an update for what the others are (its median bound, near zero), or only
        for what it is itself (non-finite): not under a stage that forbids it (dp), nor for a method whose replies
        no common median bounds (`Method.screen_by_others`: RecipFL's)."""
        return all(s.screen_by_others for s in self.stages) and (self.method is None or self.method.screen_by_others)

    def evaluated(self, rnd: int) -> None:
        """Say what the screen rejected since the last evaluation, in one line, and start counting again. The
        3x screen rejects some honest updates by design (docs/methods.md, "The default rule"), so that line is
        routine (INFO; each rejection and its reason are in the metrics and, at DEBUG, the log); a level of which
        more than ALARM of the updates (and at least 3) were rejected gets a warning: honest runs do not show it."""
        seen, rejected = self.window["seen"], self.window["rejected"]
        if rejected:
            share = ", ".join(f"{lv}: {rejected[lv]} of {seen[lv]}" for lv in sorted(rejected))
            log.info("round %d: the screen rejected %d of %d updates since the last evaluation (%s; see the "
                     "metrics' `rejected`)", rnd, sum(rejected.values()), sum(seen.values()), share)
        for lv in sorted(rejected):
            if rejected[lv] >= 3 and rejected[lv] > ALARM * seen[lv]:
                log.warning("round %d: the screen rejected %d of level %s's %d updates since the last evaluation, "
                            "more than honest runs show; the reasons are in metrics.jsonl (`rejected`)", rnd,
                            rejected[lv], lv, seen[lv])
        self.window = {"seen": Counter(), "rejected": Counter()}

    def _count(self, kind: str, per_level: dict[str, int]) -> None:
        """Add a step's counts per level to the running totals of `kind` (TOTALS)."""
        for lv, k in per_level.items():
            self.totals[kind][lv] = self.totals[kind].get(lv, 0) + k

    def new_model(self, params: dict, updates: list, subs: dict, rms: list[float], rnd: int) -> tuple[dict, dict]:
        """(the new global params, what the rule did for the metrics line) from the accepted updates."""
        for stage in self.stages:
            updates = stage.updates(updates, subs, params, rnd)
        if self.stages:   # a stage may have changed the updates (dp clips them): the rule reads their norms
            rms = norms(updates, subs, params)[1]
        new, info = self.rule.aggregate(params, of_model(updates, params), subs, rms, self.mode, self.coverage,
                                        self.owners)
        if isinstance(info.get("clipped"), dict):   # the rule's clipped updates per level
            self._count("clipped", info["clipped"])
        for stage in self.stages:
            new = stage.model(params, new, rnd)
        if self.method is not None:   # the method's own step, fed by the accepted payloads: it may replace `new`
            new = self.method.server_update(rnd, params, new, updates, subs)
        return new, info

    def info(self, rnd: int) -> dict:
        """What the stages add to round `rnd`'s metrics line (whether or not the round updated the model), the
        step's near-zero updates and the running totals (`robust_totals`; not under robust=none, which judges
        nothing)."""
        out = {k: v for stage in self.stages for k, v in stage.info(rnd).items()}
        if self.near_zero:
            out["near_zero"] = list(self.near_zero)
        if "screen" in self.rule.args:
            out["robust_totals"] = {k: dict(sorted(v.items())) for k, v in self.totals.items()}
        return out

    def halt(self, rnd: int) -> str | None:
        """Why the run must stop before round `rnd` (a stage's budget), or None."""
        return next((why for stage in self.stages if (why := stage.halt(rnd))), None)

    def state_dict(self) -> dict:
        return {"stages": [stage.state_dict() for stage in self.stages], "rule": self.rule.state_dict(),
                "totals": {k: dict(v) for k, v in self.totals.items()},
                "window": {k: dict(v) for k, v in self.window.items()},   # a resumed run's next line says the same
                **({"recent": [list(x) for x in self.recent]} if self.recent is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        for stage, s in zip(self.stages, state.get("stages", [])):
            stage.load_state_dict(s)
        self.rule.load_state_dict(state.get("rule", {}))
        self.totals = {k: dict(state.get("totals", {}).get(k, {})) for k in TOTALS}
        self.window = {k: Counter(state.get("window", {}).get(k, {})) for k in ("seen", "rejected")}
        if self.recent is not None:
            self.recent = [tuple(x) for x in state.get("recent", [])]

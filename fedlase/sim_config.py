"""What a config may say of simulated time beyond `device_model`: the device population (`population`, built by
fedlase/population.py), the schedule (`schedule`, `schedule_args`; run by fedlase/asynchronous.py) and the
staleness weights. No torch and no file read here, so validating a config stays cheap (fedlase/config.py).
docs/async.md describes both.

- fedbuff (Nguyen et al. 2022): `concurrency` clients train at once; after `buffer` updates have arrived the
  server steps by `server_lr` times, per coordinate, the staleness-weighted sum of their deltas over the count
  of updates credited there (sum_i s(tau_i) c_ij d_ij / sum_i c_ij: the weights in the numerator only, as
  published; a uniformly stale buffer takes a smaller step).
- fedasync (Xie et al. 2019): a step per arrival, x <- x + mixing * s(tau) * delta (the delta credited per
  coordinate, so a submodel moves only what it holds). The paper mixes the client's model, x <- (1 - a) x +
  a x_client; fedlase holds no old model versions, only deltas, and applies the client's delta to the current
  model: the two agree when the update is fresh (tau = 0).

tau, an update's staleness: the server steps taken between the version the client received and the step that
applies its update. s(tau): constant (1), poly ((1 + tau)^-a; a = 0.5 is FedBuff's 1/sqrt(1 + tau)) or hinge
(1 up to tau = b, then 1 / (a (tau - b) + 1)); FedAsync's three.

`replay`: an arrival record (fedlase/asynchronous.py, RECORD) whose order the event loop follows instead of the
simulated clock: the embedded engine rebuilds a recorded run, a Flower deployment's included."""
from __future__ import annotations

from pathlib import Path

from .errors import ConfigError
from .options import Option, check_options

DEVICE_KEYS = ("speed", "bandwidth", "memory")   # of `device_model`, a level-1 device's


def check_device_model(value, num_levels: int) -> None:
    """`device_model` (fedlase/simtime.py): ConfigError naming `device_model.<key>` for a key or value it does
    not take."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ConfigError("device_model", f"expected a mapping of speed, bandwidth, memory; got {value!r}")
    for key, v in value.items():
        if key not in DEVICE_KEYS:
            raise ConfigError(f"device_model.{key}", f"unknown key; expected one of {', '.join(DEVICE_KEYS)}")
        values = v if isinstance(v, list) else [v]
        if isinstance(v, list) and len(v) != num_levels:
            raise ConfigError(f"device_model.{key}", f"a list needs one value per level ({num_levels}), got {len(v)}")
        for x in values:
            if not _positive_number(x):
                raise ConfigError(f"device_model.{key}", f"expected a positive number (or a list of them), got {x!r}")


def _positive_number(x) -> bool:
    """A positive number; a string such as '1e9' counts (YAML reads 1e9 without a dot as a string)."""
    if isinstance(x, bool):
        return False
    try:
        return float(x) > 0
    except (TypeError, ValueError):
        return False

CHARGES = ("dense", "sparse")   # `sim_charge`: what a masked method's client is charged (fedlase/simtime.py)

STALENESS = ("constant", "poly", "hinge")

POPULATION = {
    "speed_spread": Option(0.0, "sigma of the lognormal factor (median 1) on each client's speed", low=0),
    "bandwidth_spread": Option(0.0, "sigma of the lognormal factor (median 1) on each client's bandwidth", low=0),
    "online": Option(None, "mean simulated seconds a client stays online (exponential; with offline); unset: "
                     "always online", kind=float, low=0, low_open=True),
    "offline": Option(None, "mean simulated seconds a client stays offline (exponential; with online)",
                      kind=float, low=0, low_open=True),
    "capacity": Option(None, "a FedScale client_device_capacity pickle: per-client speed and bandwidth (read as "
                       "plain data only)", kind=str, tags=("path",)),
    "behave": Option(None, "a FedScale client_behave_trace pickle: per-client online intervals (read as plain data "
                     "only)", kind=str, tags=("path",)),
}


def check_population(value) -> dict | None:
    """`population` checked (one-line ConfigError naming `population.<key>`), defaults filled; None when unset."""
    if value is None:
        return None
    args = check_options("population", POPULATION, value, "population")
    if (args["online"] is None) != (args["offline"] is None):
        raise ConfigError("population.online", "online and offline go together (mean seconds of each)")
    if args["behave"] is not None and args["online"] is not None:
        raise ConfigError("population.behave", "a trace says when clients are online; drop online/offline")
    if args["capacity"] is not None and (args["speed_spread"] or args["bandwidth_spread"]):
        raise ConfigError("population.capacity", "a trace gives the spread; drop speed_spread/bandwidth_spread")
    for key in ("capacity", "behave"):
        if args[key] is not None and not Path(args[key]).expanduser().is_file():
            raise ConfigError(f"population.{key}", f"file {args[key]!r} does not exist")
    return args


SCHEDULE = {
    "concurrency": Option(None, "clients training at once (C); unset: the clients a synchronous round samples",
                          kind=int, low=1),
    "buffer": Option(None, "fedbuff: updates per server step (K); unset: concurrency", kind=int, low=1),
    "staleness": Option("poly", "staleness weight s(tau): constant, poly ((1+tau)^-a) or hinge (1 up to b, then "
                        "1/(a(tau-b)+1))", choices=STALENESS),
    "a": Option(0.5, "the staleness weight's exponent (poly) or slope (hinge)", low=0),
    "b": Option(4.0, "hinge: the staleness up to which an update keeps weight 1", low=0),
    "max_staleness": Option(None, "drop an update staler than this many server steps (recorded); unset: none",
                            kind=int, low=0),
    "server_lr": Option(1.0, "fedbuff: the server's step size on the buffer's staleness-weighted sum over its "
                        "count", low=0, low_open=True),
    "mixing": Option(0.5, "fedasync: the mixing weight alpha of a fresh update", low=0, low_open=True, high=1),
    "replay": Option(None, "an arrival record (a run's arrivals.jsonl, or its folder): take arrivals in its order "
                     "instead of by simulated time (engine=embedded; docs/async.md)", kind=str, tags=("path",)),
}


def staleness_weight(args: dict, tau: int) -> float:
    """s(tau) under the checked schedule_args `args`."""
    kind, a, b = args["staleness"], args["a"], args["b"]
    if kind == "constant":
        return 1.0
    if kind == "poly":
        return float((1.0 + tau) ** -a)
    return 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1.0)


def schedule_settings(cfg, participation=None) -> dict:
    """The checked schedule_args of `cfg`, defaults filled (concurrency: the clients a round samples)."""
    args = check_options("schedule_args", SCHEDULE, cfg.schedule_args, f"schedule={cfg.schedule}")
    participation = tuple(participation if participation is not None else cfg.participation)
    if args["concurrency"] is None:
        if len(participation) > 1:
            raise ConfigError("schedule_args.concurrency", "must be set when participation is a set")
        args["concurrency"] = max(1, int(round(participation[0] * cfg.num_clients)))
    if cfg.schedule == "fedbuff" and args["buffer"] is None:
        args["buffer"] = args["concurrency"]
    if cfg.schedule == "fedasync":
        args["buffer"] = 1
    return args


def check_schedule(cfg, participation) -> dict:
    """ConfigError (one line, naming the key) for a schedule this config cannot run; returns schedule_args as given."""
    given = cfg.schedule_args
    if cfg.schedule == "sync":
        if given:
            raise ConfigError("schedule_args", "options of an asynchronous schedule; set schedule=fedbuff or "
                              "schedule=fedasync, or drop them")
        return given
    args = schedule_settings(cfg, participation)
    if cfg.schedule == "fedasync" and (given or {}).get("buffer") is not None:
        raise ConfigError("schedule_args.buffer", "fedasync steps on every arrival; buffer is fedbuff's")
    wrong = {"fedbuff": "mixing", "fedasync": "server_lr"}[cfg.schedule]
    if wrong in (given or {}):
        raise ConfigError(f"schedule_args.{wrong}", f"not an option of schedule={cfg.schedule}")
    if cfg.min_replies > args["buffer"]:   # a step holds at most `buffer` updates: every step would be skipped
        held = "its one update" if cfg.schedule == "fedasync" else f"schedule_args.buffer={args['buffer']} updates"
        raise ConfigError("min_replies", f"a schedule={cfg.schedule} step holds {held}, so min_replies="
                          f"{cfg.min_replies} would skip every step; set it to at most {args['buffer']}")
    if args["concurrency"] > cfg.num_clients:
        raise ConfigError("schedule_args.concurrency", f"at most the {cfg.num_clients} clients, got "
                          f"{args['concurrency']}")
    if cfg.engine != "embedded" and cfg.population is not None:
        raise ConfigError("population", f"on engine={cfg.engine} the nodes' own speeds and availability decide "
                          "when updates arrive; drop population")
    if args["replay"] is not None:
        if cfg.engine != "embedded":
            raise ConfigError("schedule_args.replay", "a record is replayed on engine=embedded")
        if cfg.population is not None:
            raise ConfigError("schedule_args.replay", "the record says when each update arrived; drop population")
        path = Path(args["replay"]).expanduser()
        if not (path.is_file() or (path / "arrivals.jsonl").is_file()):
            raise ConfigError("schedule_args.replay", f"{args['replay']!r} is neither an arrival record nor a run "
                              "folder holding one (arrivals.jsonl)")
    if cfg.deadline is not None:
        raise ConfigError("deadline", f"a synchronous round's; schedule={cfg.schedule} waits for no round "
                          "(schedule_args.max_staleness drops late updates)")
    from .registry import RULES
    if args["buffer"] == 1 and RULES.get(cfg.robust).compares:   # declared by the rule (Rule.compares)
        judged = ", ".join(name for name, rule in RULES.items() if not rule.compares and "screen" in rule.options)
        raise ConfigError("robust", f"robust={cfg.robust} compares a step's updates with each other; a step of one "
                          f"update (schedule={cfg.schedule}{'' if cfg.schedule == 'fedasync' else ' with buffer 1'}"
                          f") leaves it nothing to compare, so it would let anything the screen passes through; "
                          f"use {judged}, which judge an arrival against the recent ones")
    from .registry import ATTACKS
    if args["buffer"] == 1 and ATTACKS.get(cfg.attack).colludes:   # declared by the attack (Attack.colludes)
        where = cfg.schedule if cfg.schedule == "fedasync" else f"{cfg.schedule} with buffer 1"
        raise ConfigError("attack", f"attack={cfg.attack} colludes with the honest updates of a server step; a step "
                          f"of one update (schedule={where}) holds none, so it would send its own update unchanged; "
                          "use schedule=sync, or fedbuff with schedule_args.buffer of 2 or more")
    if cfg.schedule == "fedbuff" and args["staleness"] != "constant" and not RULES.get(cfg.robust).weighted:
        raise ConfigError("schedule_args.staleness", f"robust={cfg.robust} takes no weighted updates; use "
                          "schedule_args.staleness=constant or a weighted rule (screen, none)")
    return given

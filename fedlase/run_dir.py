"""A run's folder and the rules of its loop that are not training: what is written where, when a round is
evaluated, and the progress line.

A run folder holds config.json, metrics.jsonl (a line per evaluated round), checkpoint.pt, sim.json (what `fedlase
report` recomputes simulated time from) and, once finished, summary.json. `RunFolder` is the one place that reads and
writes them, so the engine's loop (fedlase/engine.py, `run_experiment`) only trains, evaluates and hands lines on."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from . import checkpoint
from .config import result_keys
from .errors import UserError
from .util import atomic_write, lines_up_to, run_folder

log = logging.getLogger("fedlase")


class FolderPort(Protocol):
    """What a run folder reads and restores of the run it writes (the engine's `Experiment` is one): its clock
    (None without one), the model version, its state (the training seconds), the server step's figures, an
    evaluation, and the whole state to save and load."""
    clock: Any
    round: int
    state: Any      # the engine's RunState
    server: Any

    def evaluate(self, rnd: int) -> dict: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class RunFolder:
    """The files of one run, opened once by `open` (a fresh run, or a resumed one at its checkpoint)."""

    def __init__(self, cfg, resume: bool):
        self.cfg, self.resume = cfg, resume
        self.path = run_folder(cfg.out, resume)
        self.checkpoint = self.path / "checkpoint.pt"
        self.metrics = self.path / "metrics.jsonl"
        self.summary = self.path / "summary.json"

    def open(self, exp: FolderPort) -> dict | None:
        """Write what describes the run, restore `exp` from the checkpoint when resuming (refusing one made under
        other settings), keep metrics.jsonl up to that checkpoint, and return its last evaluated line."""
        cfg = self.cfg
        self.path.mkdir(parents=True, exist_ok=True)
        if exp.clock is not None:
            record = exp.clock.record()
            atomic_write(self.path / "sim.json", lambda p: p.write_text(json.dumps(record)))
        lines: list[str] = []
        if self.resume and self.checkpoint.exists():
            state = checkpoint.load(self.checkpoint)   # weights-only: nothing in a run folder runs
            diff = config_changes(state["config"], cfg)
            if diff:
                raise UserError(f"out: {self.path} holds a run with other settings ({', '.join(sorted(diff))}); "
                                "use another out folder")
            exp.load_state_dict(state)
            if exp.round > cfg.rounds:
                raise UserError(f"rounds: the run in {self.path} is at round {exp.round}, beyond rounds={cfg.rounds}; "
                                f"resume with rounds >= {exp.round}")
            lines = lines_up_to(self.metrics, "round", exp.round)   # drop lines written after the checkpoint
            log.info("resuming %s at round %d", self.path, exp.round)
        (self.path / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1, default=str))
        atomic_write(self.metrics, lambda p: p.write_text("".join(ln + "\n" for ln in lines)))
        return json.loads(lines[-1]) if lines else None

    def append(self, line: dict) -> None:
        with open(self.metrics, "a") as f:
            f.write(json.dumps(line) + "\n")

    def checkpoint_due(self, rnd: int) -> bool:
        every = self.cfg.checkpoint_every
        return bool(every) and (rnd % every == 0 or rnd == self.cfg.rounds)

    def save(self, exp: FolderPort) -> None:
        checkpoint.save(exp.state_dict(), self.checkpoint)

    def finish(self, exp: FolderPort, last: dict, stopped: str | None) -> dict:
        """summary.json (and, for a run a stage stopped early, its final line and checkpoint); the summary."""
        cfg = self.cfg
        end = exp.round if stopped else cfg.rounds
        if last is None or last["round"] != end:   # e.g. resumed a finished run with more eval needed, or stopped
            last = {"round": end, "train_time": exp.state.train_time, **exp.server.info(end), **exp.evaluate(end)}
            if stopped:   # the stopped run's last line: its final model, evaluated
                self.append(last)
        if stopped and cfg.checkpoint_every:
            self.save(exp)
        summary = {"config": cfg.to_dict(), "rounds": end, "train_time": exp.state.train_time,
                   "final": last, "num_clients": cfg.num_clients}
        if stopped:
            summary["stopped"] = stopped
        atomic_write(self.summary, lambda p: p.write_text(json.dumps(summary, indent=1, default=str)))
        return summary


def config_changes(saved: dict, cfg) -> set[str]:
    """Keys whose values differ between a checkpoint's config and `cfg` and would change the result."""
    now = cfg.to_dict()
    return {k for k in result_keys() if k in saved and saved[k] != now.get(k)}


@dataclass(frozen=True)
class EvalCadence:
    """When a server step is evaluated: every `every` steps, at the last one, and (with `every_seconds`) each
    time the simulated clock crosses a multiple of it."""
    every: int
    last: int
    every_seconds: float | None = None

    @classmethod
    def of(cls, cfg) -> EvalCadence:
        return cls(cfg.eval_every, cfg.rounds, cfg.eval_every_seconds)

    def due(self, rnd: int, sim_before: float | None, sim_after: float | None) -> bool:
        t = self.every_seconds
        timed = t is not None and sim_before is not None and sim_after // t > sim_before // t
        return rnd % self.every == 0 or rnd == self.last or timed


class Progress:
    """The progress bar (tqdm): rounds done, seconds a round, the loss, simulated time, the last accuracy."""

    def __init__(self, cfg, start: int, show: bool):
        self.bar = self.redirect = None
        if show:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm
            self.redirect = logging_redirect_tqdm()   # log lines go above the bar, not through it
            self.redirect.__enter__()
            self.bar = tqdm(total=cfg.rounds, initial=start, desc=f"{cfg.method}", unit="round", dynamic_ncols=True)

    def update(self, seconds: float, line: dict, last: dict | None) -> None:
        if self.bar is None:
            return
        self.bar.update(1)
        post = {"s/round": f"{seconds:.2f}", "loss": f"{line['train_loss']:.3f}"}
        if "sim_time" in line:   # progress in simulated time
            post["sim"] = f"{line['sim_time']:.0f}s"
        if last:
            post["acc"] = f"{last['global_acc']:.3f}"
        self.bar.set_postfix(post)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.redirect.__exit__(None, None, None)

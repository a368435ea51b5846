"""Training-time analyses (trackers) that the engine calls after every round and every evaluation.

A tracker sees what the engine did and records statistics; it never changes training."""
from __future__ import annotations


class Tracker:
    """Base class: override what you need. State must round-trip through state_dict for resume."""
    key = ""

    def __init__(self, exp, options: dict | None = None):
        self.exp = exp

    def on_round(self, rnd: int, picked, submodels, old_params, new_params) -> None:
        pass

    def on_eval(self, rnd: int) -> dict | None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


TRACKERS: dict[str, type[Tracker]] = {}


def build_trackers(options: dict, exp) -> list[Tracker]:
    return [TRACKERS[k](exp, v if isinstance(v, dict) else {}) for k, v in options.items() if v and k in TRACKERS]

"""Training-time analyses (trackers) that the engine calls after every round and every evaluation.

A tracker sees what the engine did and records statistics; it never changes training. Switch one on with
the config key `analysis.<name>` (true, or its options). Small summaries go into the metrics line; the
bulky arrays go to `<out>/analysis/<name>.npz`, rewritten at every evaluation (see docs/analysis.md).

- magnitudes: per-layer max and mean |theta| of the global model at chosen rounds.
- ratios: per-layer extraction ratio (kept / size) of every level's submodel at every round, and its
  standard deviation over the last N rounds (`ratio_std`).
- updates: how many times each coordinate was part of a trained submodel; per-layer summaries, Gini
  coefficient and histogram.
- tensorboard: the per-round and per-level scalars (training loss, each level's clients and kept share, and at
  every evaluation each level's accuracies), written for TensorBoard (needs the `tensorboard` extra).
- channels: per level, the conv output channels and linear rows the evaluated submodel leaves entirely empty,
  and the share of the dense model's multiply-adds they cost.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import torch

from .errors import ConfigError
from .layers import forward_uses
from .levels import level_name
from .machine import writable_folder
from .options import Option, check_options
from .registry import register_tracker
from .util import atomic_write


class Tracker:
    """Base class: override what you need. State must round-trip through state_dict for resume."""
    key = ""
    options_spec: dict[str, Option] = {}   # the tracker's options (fedlase/options.py), checked with config

    def __init__(self, exp, options: dict | None = None):
        self.exp = exp
        self.options = options or {}

    @classmethod
    def parse_options(cls, value) -> dict:
        """The config value (true or a mapping of options) -> options; ConfigError on a bad value."""
        if value is True:
            return {}
        if isinstance(value, dict):
            checked = check_options(f"analysis.{cls.key}", cls.options_spec, value, f"analysis {cls.key}")
            return {k: v for k, v in checked.items() if k in value}
        raise ConfigError(f"analysis.{cls.key}", f"expected true, false or a mapping of options, got {value!r}")

    def on_round(self, rnd: int, picked, submodels, old_params, new_params) -> None:
        pass

    def on_eval(self, rnd: int) -> dict | None:
        return None

    def on_metrics(self, rnd: int, line: dict) -> None:
        """The round's metrics as the engine has them: every round the training figures (`train_loss`,
        `clients`, ...), and at an evaluation the whole metrics line, as written to metrics.jsonl."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    # ---- helpers -------------------------------------------------------------------------------------------
    @property
    def layers(self) -> list[str]:
        return self.exp.method.maskable

    def index(self) -> dict:
        """What the arrays' last axis runs over, saved beside them: the maskable layers."""
        return {"layers": np.array(self.layers)}

    def save_npz(self, **arrays) -> Path:
        """Write <out>/analysis/<key>.npz atomically (a crash never leaves half a file)."""
        folder = Path(self.exp.cfg.out) / "analysis"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.key}.npz"

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:   # a file object: np.savez would append ".npz" to a tmp name
                np.savez(f, **self.index(), **arrays)
        atomic_write(path, write)
        return path


def _level_names(levels) -> list[str]:
    return [level_name(lvl) for lvl in levels]


def _rounds_rule(rounds) -> str | None:
    if not isinstance(rounds, list) or not rounds or \
            not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in rounds):
        return f"rounds must be a list of integers >= 0, got {rounds!r}"
    return None


@register_tracker
class Magnitudes(Tracker):
    """Per-layer max and mean |theta| of the global model (maskable parameters).

    Option `rounds`: list of rounds after which to record (0 = the initial model); without it, every
    evaluation. Written as `rounds` (R,), `max` and `mean` (R, layers)."""
    key = "magnitudes"
    options_spec = {"rounds": Option(None, "rounds to record (0 = initial model); default: every evaluation",
                                     kind=list, check=_rounds_rule)}

    @classmethod
    def parse_options(cls, value) -> dict:
        return super().parse_options({"rounds": value} if isinstance(value, list) else value)

    def __init__(self, exp, options=None):
        super().__init__(exp, options)
        self.at = set(self.options["rounds"]) if "rounds" in self.options else None
        self.rounds: list[int] = []
        self.max: list[np.ndarray] = []
        self.mean: list[np.ndarray] = []

    def _record(self, rnd: int, params) -> None:
        if rnd in self.rounds:   # the engine may evaluate a round twice (final evaluation after a resume)
            return
        with torch.no_grad():
            a = [params[n].detach().abs() for n in self.layers]
            self.max.append(np.array([float(t.max()) for t in a]))
            self.mean.append(np.array([float(t.mean()) for t in a]))
        self.rounds.append(rnd)

    def on_round(self, rnd, picked, submodels, old_params, new_params):
        if self.at is not None:
            if rnd == 1 and 0 in self.at:
                self._record(0, old_params)
            if rnd in self.at:
                self._record(rnd, new_params)

    def on_eval(self, rnd):
        if self.at is None:
            self._record(rnd, self.exp.params)
        if self.rounds:
            self.save_npz(**self._arrays())
        return None

    def _arrays(self) -> dict:
        p = len(self.layers)
        return {"rounds": np.array(self.rounds, dtype=np.int64),
                "max": np.array(self.max).reshape(-1, p), "mean": np.array(self.mean).reshape(-1, p)}

    def state_dict(self):
        return self._arrays()

    def load_state_dict(self, state):
        self.rounds = [int(r) for r in state["rounds"]]
        self.max, self.mean = list(state["max"]), list(state["mean"])


def ratio_std(ratios: np.ndarray, last: int | None = None) -> np.ndarray:
    """Std (population, ddof=0) over rounds of each layer's ratio, over the last `last` rounds (all if None).
    ratios: (rounds, ...) -> (...)."""
    window = ratios if last is None else ratios[-last:]
    return window.std(axis=0)


@register_tracker
class Ratios(Tracker):
    """Per-layer extraction ratio (kept / size of each maskable parameter) of each level's submodel, every round.

    Levels not sampled in a round get the submodel the method would have given them (methods are pure
    functions of (params, level, round)), so the arrays have no gaps. Option `last`: `ratio_std` over the last
    N rounds (default: all). Written as `levels` (L,), `rounds` (R,), `ratios` (L, R, layers) and
    `ratio_std` (L, layers); the metrics line gets `ratio_std` per level, averaged over layers."""
    key = "ratios"
    options_spec = {"last": Option(None, "ratio_std over the last N rounds (default: all rounds)", kind=int, low=1)}

    def __init__(self, exp, options=None):
        super().__init__(exp, options)
        self.last = self.options.get("last")
        self.rounds: list[int] = []
        self.rows: list[np.ndarray] = []   # one (L, layers) array per round

    def on_round(self, rnd, picked, submodels, old_params, new_params):
        exp = self.exp
        row = []
        for lvl in exp.levels:
            sub = submodels.get(lvl)
            if sub is None:   # not sampled this round; keep the method's RNG use (if any) from touching training
                devices = [exp.device] if exp.device.type == "cuda" else []
                with torch.random.fork_rng(devices=devices):
                    sub = exp.method.submodel(old_params, lvl, rnd)
            row.append([float(sub.masks[n].sum()) / sub.masks[n].numel() if n in sub.masks else 1.0
                        for n in self.layers])
        self.rounds.append(rnd)
        self.rows.append(np.array(row))

    def ratios(self) -> np.ndarray:
        """(levels, rounds, layers)."""
        arr = np.array(self.rows).reshape(len(self.rows), len(self.exp.levels), len(self.layers))
        return arr.transpose(1, 0, 2)

    def on_eval(self, rnd):
        if not self.rows:
            return None
        r = self.ratios()
        std = ratio_std(r.transpose(1, 0, 2), self.last)   # (L, layers)
        self.save_npz(levels=np.array([float(lv) for lv in self.exp.levels]),
                      rounds=np.array(self.rounds, dtype=np.int64),
                      ratios=r, ratio_std=std)
        return {"ratio_std": dict(zip(_level_names(self.exp.levels), map(float, std.mean(axis=1))))}

    def state_dict(self):
        return {"rounds": list(self.rounds), "rows": [r.copy() for r in self.rows]}

    def load_state_dict(self, state):
        self.rounds, self.rows = list(state["rounds"]), [np.array(r) for r in state["rows"]]


def gini_from_histogram(hist: np.ndarray) -> float:
    """Gini coefficient of non-negative integers given as hist[v] = how many equal v; exact.

    For sorted x_1..x_n, G = sum_i (2i - n - 1) x_i / (n sum x); a value v with f copies at ranks a+1..a+f
    contributes v f (2a + f - n). 0 when all values are 0."""
    hist = np.asarray(hist, dtype=np.int64)
    n = int(hist.sum())
    v = np.arange(len(hist), dtype=np.float64)
    total = float((v * hist).sum())
    if n == 0 or total == 0:
        return 0.0
    below = np.concatenate([[0], np.cumsum(hist)[:-1]]).astype(np.float64)
    return float((v * hist * (2 * below + hist - n)).sum() / (n * total))


def gini(values) -> float:
    """Gini coefficient of non-negative integers (see gini_from_histogram). Public API, for counts of your own
    (the `updates` tracker works on histograms: gini_from_histogram)."""
    return gini_from_histogram(np.bincount(np.asarray(values, dtype=np.int64).ravel()))


@register_tracker
class Updates(Tracker):
    """Cumulative update counts: how many times each coordinate of a maskable parameter was part of a trained
    submodel (per sampled client: its level's mask at the start of the round; an unmasked parameter counts
    every client). Written as per-layer `mean`, `min`, `max`, `never` (share never trained), `gini` (L,)
    and `hist` (layers, max count + 1): hist[l, c] = coordinates of layer l trained c times; the metrics line
    gets `updates` = {never, gini, mean} over all maskable coordinates."""
    key = "updates"

    def __init__(self, exp, options=None):
        super().__init__(exp, options)
        self.counts = {n: torch.zeros_like(exp.params[n], dtype=torch.int32) for n in self.layers}
        self.clients = 0

    def on_round(self, rnd, picked, submodels, old_params, new_params):
        for lvl, k in Counter(lvl for _, lvl in picked).items():   # keyed by Level, never by its float
            masks = submodels[lvl].masks
            for n, c in self.counts.items():
                if n in masks:
                    c.add_(masks[n].to(torch.int32), alpha=k)
                else:
                    c.add_(k)
        self.clients += len(picked)

    def histograms(self) -> np.ndarray:
        """(layers, max count + 1) int64."""
        hists = [torch.bincount(c.flatten().cpu()).numpy() for c in self.counts.values()]
        width = max(len(h) for h in hists)
        return np.stack([np.pad(h, (0, width - len(h))) for h in hists]).astype(np.int64)

    def on_eval(self, rnd):
        hist = self.histograms()
        values = np.arange(hist.shape[1])
        size = hist.sum(axis=1)
        stats = {"mean": (hist * values).sum(axis=1) / size,
                 "min": np.array([np.flatnonzero(h)[0] for h in hist]),
                 "max": np.array([np.flatnonzero(h)[-1] for h in hist]),
                 "never": hist[:, 0] / size,
                 "gini": np.array([gini_from_histogram(h) for h in hist])}
        self.save_npz(hist=hist, size=size, clients=np.int64(self.clients), round=np.int64(rnd), **stats)
        total = hist.sum(axis=0)
        return {"updates": {"never": float(total[0] / total.sum()), "gini": gini_from_histogram(total),
                            "mean": float((total * values).sum() / total.sum()), "clients": self.clients}}

    def state_dict(self):
        return {"counts": {n: c.cpu().clone() for n, c in self.counts.items()}, "clients": self.clients}

    def load_state_dict(self, state):
        self.counts = {n: c.to(self.exp.device) for n, c in state["counts"].items()}
        self.clients = state["clients"]


def scalars(line: dict) -> dict[str, float]:
    """A metrics line's numbers as TensorBoard tags: `global_acc`; per level `global_acc/level 1/4`;
    other nested numbers joined by '/' (`updates/gini`). Strings and the round itself are left out."""
    out = {}

    def walk(value, tag: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{tag}/{k}" if tag else str(k))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[tag] = float(value)

    for key, value in line.items():
        if key == "levels":
            for lvl, metrics in value.items():
                for name, v in metrics.items():
                    walk(v, f"{name}/level {lvl}")
        elif key != "round":
            walk(value, key)
    return out


@register_tracker
class TensorBoard(Tracker):
    """The run's scalars for TensorBoard (torch.utils.tensorboard; `pip install 'fedlase[tensorboard]'`):
    every round the training loss and, per level trained, its clients (`trained_clients`) and the share of
    the budgeted parameters its submodel keeps (`trained_kept_share`); at every evaluation each level's and
    the overall accuracies and fairness, and what the other analyses put in the metrics line. The value is
    the folder (`analysis.tensorboard=DIR`), or true for `<out>/tensorboard`. A resumed run drops the events
    after its checkpoint (TensorBoard's purge_step)."""
    key = "tensorboard"
    options_spec = {"dir": Option(None, "folder of the event files (default: <out>/tensorboard)", kind=str,
                                  check=writable_folder)}

    @classmethod
    def parse_options(cls, value) -> dict:
        return super().parse_options({"dir": value} if isinstance(value, str) else value)

    def __init__(self, exp, options=None):
        super().__init__(exp, options)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("analysis.tensorboard", "needs the tensorboard package: pip install "
                              "'fedlase[tensorboard]'") from None
        self._writer_class = SummaryWriter
        self.dir = Path(self.options.get("dir") or Path(exp.cfg.out) / "tensorboard")
        self.writer = None
        sizes = {n: exp.params[n].numel() for n in self.layers}
        self._budget = sum(sizes.values())

    def _write(self, rnd: int, values: dict[str, float]) -> None:
        if self.writer is None:   # opened at the first round written: a resumed run purges what came later
            self.writer = self._writer_class(str(self.dir), purge_step=rnd)
        for tag, v in values.items():
            self.writer.add_scalar(tag, v, rnd)

    def on_round(self, rnd, picked, submodels, old_params, new_params):
        counts: dict = {}
        for _, lvl in picked:
            counts[lvl] = counts.get(lvl, 0) + 1
        values = {}
        for lvl, sub in submodels.items():
            values[f"trained_clients/level {lvl.name}"] = float(counts.get(lvl, 0))
            values[f"trained_kept_share/level {lvl.name}"] = sub.kept(self.layers, old_params) / self._budget
        self._write(rnd, values)

    def on_metrics(self, rnd, line):
        self._write(rnd, scalars(line))
        self.writer.flush()


def row_macs(model: torch.nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Weight name (2+ dims) -> multiply-adds one of its output channels (rows) costs per input: its uses in a
    forward pass of `x` (fedlase.layers.forward_uses) times one row's size."""
    params = dict(model.named_parameters())
    return {n: uses * params[n][0].numel() for n, uses in forward_uses(model, x).items()}


def empty_rows(sub, macs: dict[str, int]) -> tuple[int, int, float]:
    """(empty rows, rows, share of the dense model's multiply-adds in empty rows) of a submodel's masks: conv
    output channels and linear rows whose mask keeps nothing. A dense kernel still computes them (a conv channel
    still emits its BN bias), which is the cost of a threshold that breaks a layer's structure."""
    empty = rows = 0
    wasted = dense = 0
    for name, mask in sub.masks.items():
        if mask.dim() < 2:
            continue
        dead = int((~mask.reshape(mask.shape[0], -1).any(1)).sum())
        empty, rows = empty + dead, rows + mask.shape[0]
        wasted, dense = wasted + macs.get(name, 0) * dead, dense + macs.get(name, 0) * mask.shape[0]
    return empty, rows, wasted / max(dense, 1)


@register_tracker
class EmptyChannels(Tracker):
    """At every evaluation, per level: conv output channels and linear rows the evaluated submodel leaves
    entirely empty, and the share of the dense model's multiply-adds they cost (`empty_rows`). Written as
    `rounds` (R,), `empty` (R, levels), `rows` (R, levels), `macs_share` (R, levels), and in metrics.jsonl as
    `empty_channels` {level: share of multiply-adds}."""
    key = "channels"

    def __init__(self, exp, options=None):
        super().__init__(exp, options)
        self.rounds: list[int] = []
        self.empty: list[list[int]] = []
        self.rows: list[list[int]] = []
        self.share: list[list[float]] = []
        self._macs = None

    def on_eval(self, rnd):
        if self._macs is None:   # one test input through the model: each row's cost, once per run
            self._macs = row_macs(self.exp.model, self.exp.x_test[:1])
        figures = [empty_rows(self.exp.method.eval_submodel(self.exp.params, lvl, max(rnd, 1)), self._macs)
                   for lvl in self.exp.levels]
        if rnd not in self.rounds:   # the engine may evaluate a round twice (final evaluation after a resume)
            self.rounds.append(rnd)
            self.empty.append([f[0] for f in figures])
            self.rows.append([f[1] for f in figures])
            self.share.append([f[2] for f in figures])
            self.save_npz(**self._arrays())
        return {"empty_channels": dict(zip(_level_names(self.exp.levels), (round(f[2], 6) for f in figures)))}

    def index(self):
        return {"levels": np.array(_level_names(self.exp.levels))}

    def _arrays(self) -> dict:
        n = len(self.exp.levels)
        return {"rounds": np.array(self.rounds, dtype=np.int64), "empty": np.array(self.empty).reshape(-1, n),
                "rows": np.array(self.rows).reshape(-1, n), "macs_share": np.array(self.share).reshape(-1, n)}

    def state_dict(self):
        return self._arrays()

    def load_state_dict(self, state):
        self.rounds = [int(r) for r in state["rounds"]]
        self.empty, self.rows = [list(r) for r in state["empty"]], [list(r) for r in state["rows"]]
        self.share = [list(r) for r in state["macs_share"]]

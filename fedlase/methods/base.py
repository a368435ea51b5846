"""What a method is: an object that turns (global parameters, level, round) into a Submodel.

A method decides what each client trains (masks, and the aggregation rule's name); the engine runs the local
training and the aggregation. A method takes part in either only where it declares so: one whose clients need more
than the task's loss of one forward says how they train, through a `LocalObjective` on its submodels (each batch's
loss or a term added to it, the submodel a client trains), which `fedlase.train.local_train` calls; one with a
server step of its own declares `server_update`, which the server step calls after the rule (RecipFL, the adapter
methods). Options are declared once as `Option`s (fedlase/options.py, the same mechanism as config keys) and
checked at construction with errors that name `method_args.<key>`. A method receives the run's `System` (levels
largest first, looked up by index) and each call a `Level`; `float(level)` is its fraction."""
from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import nn

from ..config import ENGINES
from ..levels import System, as_system
from ..masks import Submodel, kth_largest, maskable_names
from ..model_facts import ModelFacts
from ..options import Option, check_options

__all__ = ["LocalObjective", "Method", "Option", "ThresholdMethod"]


class LocalObjective:
    """A method's own local training, for methods that need more than the task's loss of one forward of the
    submodel (FjORD: a width drawn per batch, self-distillation; DepthFL: every exit's loss and mutual
    distillation; FedDSE: each client's own mask, chosen on its data; HetLoRA: a penalty on its adapters' last
    rank components). A method attaches one to the Submodel it returns (`Submodel.local`);
    `fedlase.train.local_train` then calls `start` once when the client begins, and on every batch `loss` plus
    `penalty`. This base class is the plain path: it keeps the submodel, leaves the loss to the task (the
    cross-entropy for task=classify, the next-token loss for task=lm) and adds nothing. Its draws (FjORD's widths)
    come from torch's global stream, which the client seeds per round and client, so a resumed run repeats them.
    Not taken by the batched path."""

    def start(self, model: nn.Module, sub: Submodel, params: dict[str, torch.Tensor],
              buffers: dict[str, torch.Tensor], x: torch.Tensor, batches: list[torch.Tensor]) -> Submodel:
        """The submodel this client trains (its masks also cut its delta; a new one with slices trains as any
        slice). `params`: the tensors it trains, still equal to the global model's (gathered when the submodel
        is a slice); x[batches[i]]: its data."""
        return sub

    def loss(self, forward, weights: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
             xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor | None:
        """One batch's loss, or None (this base): the task's loss of one forward (`fedlase.train.task_loss`),
        which `local_train` computes. `weights`: the submodel's effective weights (`Submodel.apply`,
        differentiable); `forward(weights, buffers, *args, **kwargs)`: the model called on them. An objective
        that returns its own loss (FjORD's, DepthFL's, RecipFL's) is a classification loss."""
        return None

    def penalty(self, weights: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """A term added to every batch's loss, whichever loss that is (HetLoRA's tail penalty), from the same
        effective weights; None (this base): nothing is added."""
        return None

    # A personal objective (pFedLMT's, RecipFL's): the client trains parameters of its own, swapped in before
    # local training (`params_for`); `finish` makes its reply from what it trained (pFedLMT takes its own part
    # out; RecipFL's reply is all of it); fedlase.client.ClientTrainer calls both for every objective, and the
    # clock (fedlase/cost.py) charges a personal one as its plain submodel.
    personal: ClassVar[bool] = False

    def params_for(self, client: int, params: dict[str, torch.Tensor], sub: Submodel) -> dict[str, torch.Tensor]:
        """The parameters `client` starts its local training from: the global ones unless overridden."""
        return params

    def finish(self, client: int, params: dict[str, torch.Tensor], sub: Submodel,
               delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The delta the client sends, from the one it trained (`params`: what `params_for` gave): itself unless
        overridden (a personal objective's; FedDSE's adds the channels it chose, `Method.own_reply`)."""
        return delta


TRAIN_PATHS = (ENGINES[0], "batched", *ENGINES[1:])   # what a method's `runs_on` may list: the engines, and batched


class Method:
    """Base class. Subclasses set `name`, `options` and implement `submodel`."""
    name: ClassVar[str] = ""
    options: ClassVar[dict[str, Option]] = {}
    coverage: ClassVar[str] = "mask"   # the aggregation's coverage rule unless the config sets one
    # Where its clients can train, checked at config validation: of TRAIN_PATHS, "embedded" is the sequential
    # rounds and "batched" the embedded engine's batched_clients=true. A method whose submodels carry their own
    # LocalObjective leaves out "batched" (the vmapped step does not run it); a Flower node rebuilds the objective
    # with its own copy of the method (fedlase/flower/client_app.py, `with_objective`), so Flower runs it where it
    # is a function of the config, the level, the round and the model (FjORD's, DepthFL's, FedDSE's). A method that
    # leaves out an engine says why in `confined`, which the config's refusal names.
    runs_on: ClassVar[tuple[str, ...]] = TRAIN_PATHS
    confined: ClassVar[str] = ""
    # The models (registry names) it can run on, checked at config validation; None: any model.
    models: ClassVar[tuple[str, ...] | None] = None
    # whether the simulated clock (fedlase/simtime.py) can charge it: it costs a client as its level's submodel of
    # the global model; a method whose clients or server compute something else (RecipFL) refuses simulated time
    clocked: ClassVar[bool] = True
    # whether a client's mask depends on its own data (FedDSE): then which coordinates it sent is private too,
    # and differential privacy refuses the method (fedlase/robust_config.py, check_dp)
    masks_from_data: ClassVar[bool] = False
    # the server stages its training goes through (fedlase/server_step.py, ServerStep): "rule" (any `robust`), "attack"
    # and "dp"; config validation refuses the others (fedlase/robust_config.py, check_stages). Every method's replies
    # pass the default rule's screen (a non-finite one is dropped). A method that trains outside the global model
    # (RecipFL: its clients reply with the change of their generated models, on which its hypernetwork steps in
    # `server_update`) declares () and runs under the default rule, which leaves the global model as it is; a
    # method that aggregates the updates its own way (HetLoRA, FlexLoRA, FLoRA) declares ("attack",): its
    # `server_update` replaces the rule's mean.
    server_stages: ClassVar[tuple[str, ...]] = ("rule", "attack", "dp")
    # whether the screen may reject one of its replies for what the others are (the default rule's median bound,
    # near zero), or only for what it is itself (non-finite): False where the replies are not updates of one
    # model at one scale (RecipFL's: a Goliath's change of two models, a David's of its small one)
    screen_by_others: ClassVar[bool] = True
    # whether it trains LoRA adapters only (fedlase/llm/lora_methods.py): the config must then set `lora`
    adapters: ClassVar[bool] = False
    # whether a client is evaluated on a model of its own (`personal_weights`) rather than its level's submodel
    personalized: ClassVar[bool] = False
    # a personalized method's global accuracy: the mean of its clients' own models' on the whole test set, or,
    # False, not computed (NaN)
    global_eval: bool = True
    # what fedlase knows of the model (its channel groups, declared or traced: fedlase/model_facts.py); the run's,
    # handed in by `build`, else the model's own hooks alone (a method built directly on a model)
    facts: ModelFacts | None = None

    def __init__(self, model: nn.Module, system: System | list = (1.0,), *, run_seed: int | None = None,
                 **options):
        self.model = model
        if self.facts is None:
            self.facts = ModelFacts(model)
        self.system = as_system(system)
        self.maskable = maskable_names(model)
        self.args = check_options("method_args", self.options, options, self.name)
        # the run's seed; without `run_seed`, the seed torch was last seeded with (the engine seeds it with
        # the run's seed just before it builds the model and this method)
        self.seed = torch.initial_seed() if run_seed is None else int(run_seed)

    def generator(self, level, round: int) -> torch.Generator:
        """A method's only source of randomness: a fresh CPU generator seeded from (run seed, round, level), so
        a submodel is a function of (params, level, round, seed). Training and evaluation of a round then get
        the same submodel, and a resumed run the same as an uninterrupted one (docs/library.md)."""
        from ..sampling import Stream, derive_seed
        index = getattr(level, "index", None)
        if index is None:   # a bare fraction (library calls): its level in this method's system
            found = self.system.find(level)
            if found is None:
                raise ValueError(f"level {level} is not one of the system's levels")
            index = found.index
        return torch.Generator().manual_seed(derive_seed(self.seed, round, Stream.METHOD, int(index)))

    @classmethod
    def build(cls, model: nn.Module, system, facts: ModelFacts, **kwargs) -> Method:
        """`cls(model, system, **kwargs)` reading `facts`, the run's ModelFacts of `model` (fedlase.engine.build_parts
        calls this): they are in place before the constructor runs, so the constructor reads them as `self.facts`
        and keeps its signature (a plugin's too)."""
        method = cls.__new__(cls)
        method.facts = facts
        method.__init__(model, system, **kwargs)
        return method

    @classmethod
    def check_args(cls, options: dict) -> dict:
        """Check method_args without building the method (config validation)."""
        return check_options("method_args", cls.options, options, cls.name)

    @classmethod
    def prepare_model(cls, model: nn.Module, options: dict) -> nn.Module:
        """The model this method trains, from the one the config names, before its parameters are read: the
        model itself unless a method adds parts of its own (DepthFL's exit classifiers). Called by the model
        builders with the run's method_args; must be deterministic (it runs after the run's seed is set)."""
        return model

    @classmethod
    def prepare_model_for(cls, model: nn.Module, options: dict, system: System) -> nn.Module:
        """`prepare_model` with the run's levels, for a method whose model depends on them (FedLMT's rank is its
        weakest level's). What the model builders call."""
        return cls.prepare_model(model, options)

    @property
    def aggregation(self) -> str:
        """'coverage' (per-coordinate mean over the clients that trained it) or 'mean' (divide by |A|)."""
        return "coverage"

    def submodel(self, params: dict[str, torch.Tensor], level, round: int) -> Submodel:
        """The submodel of the given resource level at this round. All clients of a level share it."""
        raise NotImplementedError

    def eval_submodel(self, params: dict[str, torch.Tensor], level, round: int) -> Submodel:
        """The submodel a level is evaluated with after `round`; the training submodel unless overridden."""
        return self.submodel(params, level, round)

    def budget(self, params: dict[str, torch.Tensor], level) -> int:
        """Maskable coordinates a client of this level may hold: int(level * maskable count), as FIARSE
        (computed in float, as the official code does)."""
        return int(float(level) * sum(params[n].numel() for n in self.maskable))

    def bind_data(self, y_train: torch.Tensor, client_train: list, num_classes: int) -> None:
        """What clients tell the server when they register, for a method whose server uses it (RecipFL: each
        client's label histogram and data share): the training labels and each client's indices into them.
        Called once by the engine after the method is built; nothing by default."""

    def server_update(self, rnd: int, params: dict[str, torch.Tensor], new: dict[str, torch.Tensor], updates: list,
                      subs: dict) -> dict[str, torch.Tensor]:
        """The method's own server step on round `rnd`'s accepted updates (engine `Update`s: their payload, the
        `delta` a client sent, and the submodel it was sent, `u.sub or subs[u.level]`), called by the server step
        after the rule and the stages made `new` from `params` (fedlase/server_step.py, ServerStep.new_model).
        Returns the new global parameters: `new` unless the method aggregates its own way (HetLoRA, FlexLoRA,
        FLoRA: fedlase/llm/lora_methods.py). RecipFL steps its hypernetwork here and keeps `new`."""
        return new

    def own_reply(self, level) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of the tensors of its own that a client of `level` sends beside its delta, under
        names no parameter has (FedDSE's channel choice, which its `server_update` counts): a Flower server accepts
        a reply with exactly these beside the delta (fedlase/flower/codec.py, validate_reply), and the clock charges
        them (fedlase/cost.py). Nothing by default."""
        return {}

    # ---- evaluation (fedlase/evaluate.py) ---------------------------------------------------------------------
    def module_for(self, level) -> nn.Module:
        """The module a level's clients are evaluated on: the run's model, unless a level is a model of its own."""
        return self.model

    def personal_weights(self, client: int, level, weights: dict[str, torch.Tensor],
                         sub: Submodel) -> dict[str, torch.Tensor]:
        """The weights `client` of `level` is evaluated with, for a `personalized` method (`weights`: the level's
        submodel's); the level's own unless overridden."""
        return weights

    def held_params(self, level, sub: Submodel, params: dict[str, torch.Tensor]) -> int:
        """Budgeted parameters a client of `level` holds (the metrics' `kept`): those `sub` keeps of `params`."""
        return sub.kept(self.maskable, params)

    # Methods with state across rounds override these; the engine checkpoints them.
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


STE = Option("official", "gradient through the threshold mask: official (g*mask, what the official FIARSE code "
             "computes), paper (the FIARSE paper's straight-through rule), fixed (mask fixed for the round: the "
             "FedLASE rebuttal's 'w/o STE')", choices=("official", "paper", "fixed"))
OVERLAP = Option(True, "true: average each coordinate over the clients that trained it; false: divide by the "
                 "number of clients (the FedLASE rebuttal's 'w/o overlap')", choices=(True, False))


class ThresholdMethod(Method):
    """Magnitude-threshold methods (FIARSE, FedLASE): a submodel keeps, per group of parameters, the
    coordinates with |w| >= that group's threshold tau; the client keeps the thresholds and re-evaluates its
    mask at each forward (`ste`), and the server averages each coordinate over the clients that trained it
    (`overlap`). Subclasses only say how many coordinates each group keeps (`group_budgets`)."""
    options = {"ste": STE, "overlap": OVERLAP}

    @property
    def aggregation(self) -> str:
        return "coverage" if self.args["overlap"] else "mean"

    def group_budgets(self, params: dict[str, torch.Tensor], level) -> list[tuple[list[str], int]]:
        """[(parameter names of a group, coordinates it keeps)]; maskable names in no group are kept whole."""
        raise NotImplementedError

    def submodel(self, params, level, round):
        masks, thresholds = {}, {}
        for names, k in self.group_budgets(params, level):
            a = [params[n].detach().abs() for n in names]
            tau = kth_largest(torch.cat([t.flatten() for t in a]), k) if k > 0 else math.inf
            for n, t in zip(names, a):
                masks[n] = t >= tau
                thresholds[n] = tau
        if self.args["ste"] == "fixed":
            return Submodel(masks)
        return Submodel(masks, thresholds=thresholds, ste=self.args["ste"])

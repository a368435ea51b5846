"""RecipFL ("How Few Davids Improve One Goliath", Zhang et al., WWW 2024; the authors' code jiayunz/RecipFL): the
server holds no global model but a graph hypernetwork (fedlase/methods/ghn.py) that generates every client's model
each round. See docs/methods.md, "RecipFL".

Clients of the system's largest level are Goliaths: each holds the run's model (LeNet-5, or ResNet-18) and its
small variant (the slim LeNet-5, or ResNet-18 at 0.2 of its width), and trains both. Every other client is a David
and holds only the small variant. A round: the hypernetwork generates each sampled client's models from their
graphs, the summaries of what that client last uploaded, and its label histogram; the client trains them (plain
SGD; a Goliath's small model may also learn from its large one, `distill`) and reply with what they trained,
as any client does: the change of each model ('<large|small>.<name>', its payload). The server step
(fedlase/server_step.py) screens the replies as any others, by the screen's per-update checks (a non-finite one is
dropped; `screen_by_others`), then `RecipFL.server_update` adds each accepted change to what the server generated
for that client (the upload), pushes (generated - uploaded) back through the generated tensors (a vector-Jacobian
product, as pFedHN) into the hypernetwork's gradient, clips its norm and takes one Adam step. The run's own model
(the engine's global parameters) is never trained: no reply holds a tensor of it, so the rule leaves it as it is;
it runs under the default rule only, without attack or dp (`server_stages`), which would act on a model it does
not train.

It is personalized: a client is evaluated on the model generated for it (a Goliath on its large model), after
`eval_finetune` epochs of local training as RecipFL reports (set eval_finetune=1)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from ..errors import ConfigError
from ..masks import Submodel, maskable_names
from ..models.lenet import LeNet5
from ..models.resnet import ResNet18
from ..registry import register_method
from ..sampling import Stream, derive_seed
from ..train import classifier_names
from .base import LocalObjective, Method, Option
from .ghn import GraphHyperNetwork

__all__ = ["RecipFL", "david_model"]

LARGE, SMALL = "large", "small"
DAVID_WIDTH = 0.2   # RecipFL's CIFAR David: ResNet-18 at 0.2 of the width


def david_model(model: nn.Module) -> nn.Module:
    """The small model a David holds (and a Goliath beside its own): LeNet-5's slim variant, or ResNet-18 at 0.2
    of the model's width; a one-line ConfigError for a model RecipFL has no small variant of."""
    if isinstance(model, LeNet5) and not model.slim:
        return model.twin()
    if isinstance(model, ResNet18):
        c, side = model.input_shape[0], model.input_shape[1]
        return ResNet18(c, model.num_classes, width=model.widths[0] / 64 * DAVID_WIDTH, bn=model.bn_mode,
                        image_size=side)
    raise ConfigError("model", f"recipfl needs model=lenet (its MNIST setting) or resnet18 (its CIFAR setting); "
                      f"{type(model).__name__} has no David variant")


class Adam:
    """torch.optim.Adam's default update (betas 0.9 and 0.999, eps 1e-8, bias-corrected, no weight decay),
    written out as fedlase.train.SGD is: constructing a torch.optim optimizer imports torch._dynamo, seconds of a
    process's start."""

    def __init__(self, params: list[torch.Tensor], lr: float, betas=(0.9, 0.999), eps: float = 1e-8):
        self.params, self.lr, self.betas, self.eps = list(params), lr, betas, eps
        self.step_count = 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        b1, b2 = self.betas
        c1, c2 = 1 - b1 ** self.step_count, 1 - b2 ** self.step_count
        for p, m, v in zip(self.params, self.m, self.v):
            if p.grad is None:
                continue
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            p.addcdiv_(m, (v / c2).sqrt_().add_(self.eps), value=-self.lr / c1)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        return {"step": self.step_count, "m": self.m, "v": self.v}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step"])
        for mine, saved in ((self.m, state["m"]), (self.v, state["v"])):
            for t, s in zip(mine, saved):
                t.copy_(s)


class Generated(LocalObjective):
    """A RecipFL client's round: its models from the hypernetwork (`params_for`) and their training (`loss`); its
    reply is the change it trained (no `finish` of its own), which the server step hands to
    `RecipFL.server_update`. Parameters are named '<large|small>.<name>'."""
    personal = True

    def __init__(self, method: RecipFL, level, round: int):
        self.method, self.level, self.round = method, level, round

    def kinds(self) -> tuple[str, ...]:
        return (LARGE, SMALL) if self.level.index == 0 else (SMALL,)

    def params_for(self, client: int, params: dict, sub: Submodel) -> dict:
        m = self.method   # no step here: every client of a round gets its models from the same hypernetwork
        out = {}
        with torch.random.fork_rng(devices=m.cuda):   # the summary encoder's dropout: the (round, client) stream
            torch.manual_seed(derive_seed(m.seed, self.round, Stream.HYPERNET, client))
            m.ghn.train()
            for kind in self.kinds():
                gen = m.generate(client, kind)
                start = {n: t.detach() for n, t in m.full(client, kind, gen).items()}
                m.pending[(client, kind)] = (gen, start)   # what the server sent, kept with its graph for the reply
                out.update({f"{kind}.{n}": t for n, t in start.items()})
        return out

    def loss(self, forward, weights, buffers, xb, yb):
        m = self.method
        small = {n[len(SMALL) + 1:]: w for n, w in weights.items() if n.startswith(SMALL + ".")}
        s_feat, s_out = m.run(SMALL, small, xb)
        loss = F.cross_entropy(s_out, yb)
        if self.level.index != 0:
            return loss
        large = {n[len(LARGE) + 1:]: w for n, w in weights.items() if n.startswith(LARGE + ".")}
        l_feat, l_out = m.run(LARGE, large, xb)
        loss = loss + F.cross_entropy(l_out, yb)
        if m.args["distill"]:   # the large model teaches the small one: its soft labels, and its features where
            t_out = l_out.detach()   # the two models' last hidden layers have the same size
            loss = loss + F.cross_entropy(s_out, t_out.softmax(1))
            if s_feat is not None and l_feat is not None and s_feat.shape == l_feat.shape:
                loss = loss + F.kl_div(F.log_softmax(s_feat, 1), F.softmax(l_feat.detach(), 1), reduction="batchmean")
        return loss


@register_method
class RecipFL(Method):
    """RecipFL: a server graph hypernetwork generates each client's models (a Goliath both, a David the small)."""
    name = "recipfl"
    runs_on = ("embedded",)
    confined = ("its hypernetwork generates each client's models in the server's process, which a Flower node "
                "cannot do")
    models = ("lenet", "resnet18")   # the models with a David variant (david_model)
    clocked = False   # the clock would charge its clients as the run's model and its hypernetwork as nothing
    server_stages = ()   # its training is the hypernetwork's step, not the run's model a rule, attack or dp acts on
    screen_by_others = False   # a Goliath's reply (two models) and a David's (one) share no median: non-finite only
    personalized = True   # a client is evaluated on the model generated for it
    options = {
        "lr": Option(1e-3, "the hypernetwork's Adam learning rate", low=0, low_open=True),
        "clip": Option(50.0, "the norm the hypernetwork's gradient is clipped to before each step",
                       low=0, low_open=True),
        "hidden": Option(128, "the hypernetwork's node embedding size (the authors' node_hid)", kind=int, low=4),
        "distill": Option(False, "a Goliath's small model also learns from its large one (soft labels at "
                          "temperature 1, and a KL term on the last hidden features where their sizes match)",
                          choices=(True, False)),
        "weighting": Option("sum", "how the round's clients' vector-Jacobian products add up: sum (the authors' "
                            "MNIST setting) or data (weighted by each client's share of the training data, their "
                            "CIFAR setting)", choices=("sum", "data")),
        "ve_cutoff": Option(50, "virtual edges join nodes at most this many edges apart", kind=int, low=1),
    }

    def __init__(self, model, system=(1.0,), *, run_seed=None, **options):
        super().__init__(model, system, run_seed=run_seed, **options)
        if any(getattr(m, "track_running_stats", False) for m in model.modules()):
            raise ConfigError("bn", "recipfl runs with bn=batch (each generated model uses batch statistics; "
                              "it keeps no running statistics per client)")
        device = next(model.parameters()).device
        small = david_model(model).to(device)
        self.nets = {LARGE: model, SMALL: small}
        self.trainable = {k: [n for n, p in m.named_parameters() if p.requires_grad] for k, m in self.nets.items()}
        self.initial = {k: {n: p.detach().clone() for n, p in m.named_parameters()} for k, m in self.nets.items()}
        classes = classifier_names(model)
        num_classes = dict(model.named_parameters())[classes[0]].shape[0]
        self.cuda = [device] if device.type == "cuda" else []   # the streams a seeded draw must leave as they were
        with torch.random.fork_rng(devices=self.cuda):   # its initialisation from the run's seed, not the global stream
            torch.manual_seed(derive_seed(self.seed, 0, Stream.HYPERNET))
            self.ghn = GraphHyperNetwork(self.nets, classes, num_classes, self.args["hidden"],
                                         self.args["ve_cutoff"]).to(device)
        self.opt = Adam(list(self.ghn.parameters()), lr=self.args["lr"])
        self.last: dict[int, dict[str, dict[str, torch.Tensor]]] = {}   # client -> kind -> its last upload
        # (client, kind) -> (generated tensors, with their graph; what the client was sent): this round's, until
        # the server step reads the clients' replies against them
        self.pending: dict = {}
        self.histograms: dict[int, torch.Tensor] = {}
        self.shares: dict[int, float] = {}
        self.weight_sum = 0.0   # the round's accumulated client weights (0: nothing to step on)
        self._subs: dict = {}

    # ---- what the clients told the server at registration ---------------------------------------------------
    def bind_data(self, y_train: torch.Tensor, client_train: list, num_classes: int) -> None:
        """Each client's label histogram (normalised: the hypernetwork's classifier input) and data share."""
        total = sum(len(i) for i in client_train)
        for c, idx in enumerate(client_train):
            h = torch.bincount(torch.as_tensor(y_train)[torch.as_tensor(idx, dtype=torch.long)].cpu(),
                               minlength=num_classes).float()
            self.histograms[c] = h / h.sum().clamp(min=1)
            self.shares[c] = len(idx) / max(total, 1)

    def share(self, client: int) -> float:
        return self.shares.get(client, 1.0) if self.args["weighting"] == "data" else 1.0

    # ---- the hypernetwork -----------------------------------------------------------------------------------
    def last_of(self, client: int, kind: str) -> dict[str, torch.Tensor]:
        """What the client last uploaded for this model (before its first upload: the model's initial weights)."""
        return self.last.get(client, {}).get(kind) or self.initial[kind]

    def generate(self, client: int, kind: str) -> dict[str, torch.Tensor]:
        hist = self.histograms.get(client)
        if hist is None:
            raise RuntimeError("recipfl: the clients' label histograms were not given (RecipFL.bind_data)")
        return self.ghn(kind, self.last_of(client, kind), hist)

    def full(self, client: int, kind: str, gen: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every trainable tensor of the model: the generated ones, and the client's own last BN biases (no
        graph node generates them, as in GHN-2)."""
        last = self.last_of(client, kind)
        return {n: gen[n] if n in gen else last[n] for n in self.trainable[kind]}

    def accumulate(self, gen: dict[str, torch.Tensor], uploaded: dict[str, torch.Tensor], weight: float) -> None:
        """Add weight x the vector-Jacobian product of the generated tensors with (generated - uploaded) to the
        hypernetwork's gradient (the gradient of 0.5 * ||generated - uploaded||^2)."""
        names = list(gen)
        params = [p for p in self.ghn.parameters() if p.requires_grad]
        grads = torch.autograd.grad([gen[n] for n in names], params,
                                    grad_outputs=[(gen[n] - uploaded[n]).detach() for n in names], allow_unused=True)
        for p, g in zip(params, grads):
            if g is not None:
                p.grad = weight * g if p.grad is None else p.grad + weight * g
        self.weight_sum += weight

    def server_update(self, rnd: int, params: dict, new: dict, updates: list, subs: dict) -> dict:
        """The round's server step on its accepted replies, in their order: each model's upload (what the server
        sent the client plus the change it replied with) is recorded as the client's last and pushed into the
        hypernetwork's gradient, then one step (`settle`). A rejected reply, or a round without enough replies,
        never gets here: what was generated for it is dropped."""
        for u in updates:
            for kind in (LARGE, SMALL):
                if (u.client, kind) not in self.pending:   # a David has no large model
                    continue
                gen, start = self.pending[(u.client, kind)]
                up = {n: (start[n] + u.delta[f"{kind}.{n}"]).detach().clone() for n in self.trainable[kind]}
                self.last.setdefault(u.client, {})[kind] = up
                self.accumulate(gen, {n: up[n] for n in gen}, self.share(u.client))
        self.pending.clear()
        self.settle()
        return new   # the run's own model is never trained: no reply holds a tensor of it

    def settle(self) -> None:
        """The hypernetwork step on the accumulated gradient (a mean over the clients' weights under
        weighting=data), clipped to `clip`, one Adam step."""
        if self.weight_sum == 0:
            return
        params = [p for p in self.ghn.parameters() if p.grad is not None]
        if self.args["weighting"] == "data":
            for p in params:
                p.grad /= self.weight_sum
        nn.utils.clip_grad_norm_(params, self.args["clip"])
        self.opt.step()
        self.opt.zero_grad()
        self.weight_sum = 0.0

    def run(self, kind: str, weights: dict, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(last hidden features or None, logits) of model `kind` on `weights`."""
        module = self.nets[kind]
        if isinstance(module, LeNet5):
            return functional_call(module, weights, (x,), {"with_features": True})
        return None, functional_call(module, weights, (x,))

    # ---- the engine's side ----------------------------------------------------------------------------------
    def submodel(self, params, level, round):
        key = (level.index, round)
        if key not in self._subs:
            self._subs = {key: Submodel(local=Generated(self, level, round))}
        return self._subs[key]

    def module_for(self, level) -> nn.Module:
        """The model a level's clients are evaluated with: a Goliath's large model, a David's small one."""
        return self.nets[LARGE if level.index == 0 else SMALL]

    def personal_weights(self, client: int, level, weights: dict, sub: Submodel) -> dict:
        """The model generated for `client` now (the hypernetwork in evaluation mode, no dropout)."""
        kind = LARGE if level.index == 0 else SMALL
        self.ghn.eval()
        with torch.no_grad():
            return self.full(client, kind, self.generate(client, kind))

    def held_params(self, level, sub, params) -> int:
        """Budgeted parameters (conv and linear weights and biases, as every level counts them) of the model a
        client of `level` is evaluated on."""
        net = self.module_for(level)
        budgeted = set(maskable_names(net))
        return sum(p.numel() for n, p in net.named_parameters() if n in budgeted)

    def state_dict(self) -> dict:
        return {"ghn": self.ghn.state_dict(), "opt": self.opt.state_dict(), "last": self.last}

    def load_state_dict(self, state: dict) -> None:
        self.pending = {}   # a restored server holds no round in flight
        if not state:
            return
        self.ghn.load_state_dict(state["ghn"])
        self.opt.load_state_dict(state["opt"])
        self.last = {int(c): {k: dict(t) for k, t in per.items()} for c, per in state["last"].items()}

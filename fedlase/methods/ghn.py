"""RecipFL's graph hypernetwork (after GHN-2, "Parameter Prediction for Unseen Deep Architectures"), written for
fedlase's models. It maps a model's computation graph, and what a client last sent, to every trainable tensor of
that model (docs/methods.md, "RecipFL").

- **The graph** (`ModelGraph`): one node per weight tensor of a conv, linear or BN layer (types conv, linear, bn),
  one per conv or linear bias (type bias), one per pooling, residual sum or concatenation, and the input. An
  activation, flatten or reshape is no node (its edges pass through). Edges follow the forward pass (a layer's
  weight node feeds its bias node, which feeds the next layer); virtual edges join every pair of nodes joined by a
  forward path of length <= `ve_cutoff`, labelled with that length. The graph is read from a torch.fx trace of
  the module, so every fedlase model that fx can trace gets one. A BN bias is no node (as in GHN-2): RecipFL's
  client gets its own last uploaded BN bias back.
- **Node features**: the node type's embedding, plus an embedding of the tensor's shape (channel dims by
  log2 bucket, kernel dims by size), plus a transformer encoding of a 128-value summary of the client's last
  uploaded tensor (the tensor, flattened, averaged over 128 equal chunks when it is longer).
- **A gated GNN** (one forward then one backward sweep over the nodes in topological order; each node's GRU
  takes the sum of an MLP of its one-hop neighbours and of another MLP of every virtual-edge neighbour divided by
  the path length), then a LayerNorm.
- **Decoders**, one per node type, each emitting the element-wise largest shape that type has in any of the
  models; a tensor is the corner slice of its type's output, so models of different widths share decoders. The
  classifier's weight and bias take the decoder's first layer, add an embedding of the client's label histogram,
  and go through a head of their own (a kind only the classifier has, as ResNet-18's linear and bias, gets a
  decoder of that first layer alone).
- **Fan-in normalisation** of each generated tensor (weights scaled by sqrt(gain / fan-in), BN weights mapped
  into (0, 2), biases into (-1, 1)), as GHN-2 does."""
from __future__ import annotations

import inspect
import math
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..errors import ConfigError

NODE_TYPES = ("input", "conv", "linear", "bn", "bias", "avg_pool", "max_pool", "glob_avg", "sum", "concat")
SUMMARY = 128   # values summarising a client's last tensor (GHN's max_param_len)
_POOLS = {nn.AvgPool2d: "avg_pool", nn.MaxPool2d: "max_pool", nn.AdaptiveAvgPool2d: "glob_avg",
          F.avg_pool2d: "avg_pool", F.max_pool2d: "max_pool", F.adaptive_avg_pool2d: "glob_avg"}
_SUMS = (operator.add, torch.add, operator.iadd)


@dataclass
class ModelGraph:
    """A model's graph: per node its type, the parameter it generates (None for an op node) and that tensor's
    shape; `edges` (src, dst, path length) in topological order of the nodes, one-hop edges length 1."""
    types: list[str]
    params: list[str | None]
    shapes: list[tuple | None]
    edges: list[tuple[int, int, int]]

    @classmethod
    def of(cls, model: nn.Module, ve_cutoff: int = 50) -> ModelGraph:
        # the forward's optional arguments at their defaults (a model's options, e.g. DepthFL's depth)
        options = list(inspect.signature(model.forward).parameters.values())[1:]
        fixed = {a.name: a.default for a in options if a.default is not inspect.Parameter.empty}
        try:
            traced = fx.symbolic_trace(model, concrete_args=fixed)
        except Exception as e:   # a forward fx cannot follow: a one-line error naming the model
            raise ConfigError("model", f"recipfl cannot read the graph of {type(model).__name__}: {e}") from None
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        types, params, links = [], [], set()
        ends: dict[fx.Node, list[int]] = {}   # an fx node -> the graph nodes its output comes from

        def add(kind, param=None, sources=()):
            types.append(kind)
            params.append(param)
            i = len(types) - 1
            links.update((s, i) for s in sources)
            return i

        for node in traced.graph.nodes:
            inputs = sorted({i for a in node.all_input_nodes for i in ends.get(a, [])})
            if node.op == "placeholder":   # the first argument is the input; others (options) are no node
                ends[node] = [] if "input" in types else [add("input")]
                continue
            kind, chain = None, []
            if node.op == "call_module":
                mod = traced.get_submodule(node.target)
                if isinstance(mod, (nn.Conv2d, nn.Linear)):
                    kind = "conv" if isinstance(mod, nn.Conv2d) else "linear"
                    chain = [(kind, f"{node.target}.weight")] + \
                        ([("bias", f"{node.target}.bias")] if mod.bias is not None else [])
                elif isinstance(mod, nn.BatchNorm2d):
                    chain = [("bn", f"{node.target}.weight")] if mod.weight is not None else []
                elif type(mod) in _POOLS:
                    chain = [(_POOLS[type(mod)], None)]
            elif node.op == "call_function":
                if node.target in _POOLS:
                    chain = [(_POOLS[node.target], None)]
                elif node.target in _SUMS and len(inputs) > 1:
                    chain = [("sum", None)]
                elif node.target is torch.cat and len(inputs) > 1:
                    chain = [("concat", None)]
            if not chain:   # activations, flatten, views: the output comes from where the input came from
                ends[node] = inputs
                continue
            sources = inputs
            for kind, param in chain:
                sources = [add(kind, param, sources)]
            ends[node] = sources
        n = len(types)
        # virtual edges: every forward path of length <= ve_cutoff, by breadth-first search from each node
        out = [[] for _ in range(n)]
        for s, d in sorted(links):
            out[s].append(d)
        edges = []
        for s in range(n):
            dist, frontier = {s: 0}, [s]
            while frontier:
                nxt = []
                for u in frontier:
                    for v in out[u]:
                        if v not in dist and dist[u] < ve_cutoff:
                            dist[v] = dist[u] + 1
                            nxt.append(v)
                frontier = nxt
            edges += [(s, d, k) for d, k in sorted(dist.items()) if k > 0]
        missing = [p for p in shapes if p not in params and not _is_norm_bias(model, p)]
        if missing:
            raise ConfigError("model", f"recipfl: {type(model).__name__} has parameters its graph does not reach "
                              f"({', '.join(missing[:3])})")
        return cls(types, params, [shapes.get(p) if p else None for p in params], edges)


def _is_norm_bias(model: nn.Module, name: str) -> bool:
    owner = model.get_submodule(name.rpartition(".")[0])
    return isinstance(owner, nn.BatchNorm2d) and name.endswith(".bias")


def summarize(t: torch.Tensor, size: int = SUMMARY) -> torch.Tensor:
    """A tensor as at most `size` values: flattened, and averaged over `size` equal consecutive chunks when
    longer (the remainder after size * (numel // size) values is left out)."""
    flat = t.detach().reshape(-1).float()
    if flat.numel() <= size:
        return flat
    step = flat.numel() // size
    return flat[: step * size].view(size, step).mean(1)


def _mlp(*sizes: int, last_relu: bool = True) -> nn.Sequential:
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class SummaryEncoder(nn.Module):
    """Each node's summary (a sequence of up to SUMMARY scalars) -> one vector: a scalar embedding plus sinusoidal
    positions, one post-norm transformer encoder layer (4 heads, feed-forward 64, dropout 0.5: the settings of
    RecipFL's weight encoder), a LayerNorm, the mean over the sequence. Written out: torch's own layer checks a
    padding mask with sympy, a second of every process's first call."""

    def __init__(self, hid: int, heads: int = 4, ff: int = 64, dropout: float = 0.5):
        super().__init__()
        if hid % heads:
            raise ConfigError("method_args.hidden", f"must be a multiple of {heads} (the summary encoder's heads)")
        self.heads = heads
        self.embed = nn.Linear(1, hid)
        pos = torch.arange(SUMMARY).unsqueeze(1)
        freq = torch.exp(torch.arange(0, hid, 2) * (-math.log(10000.0) / hid))
        pe = torch.zeros(SUMMARY, hid)
        pe[:, 0::2] = torch.sin(pos * freq)
        pe[:, 1::2] = torch.cos(pos * freq)[:, : hid // 2]
        self.register_buffer("positions", pe, persistent=False)
        self.qkv, self.proj = nn.Linear(hid, 3 * hid), nn.Linear(hid, hid)
        self.ff = nn.Sequential(nn.Linear(hid, ff), nn.ReLU(), nn.Dropout(dropout), nn.Linear(ff, hid))
        self.norm1, self.norm2, self.norm = nn.LayerNorm(hid), nn.LayerNorm(hid), nn.LayerNorm(hid)
        self.drop = nn.Dropout(dropout)

    def forward(self, seqs: list[torch.Tensor]) -> torch.Tensor:
        length = max(len(s) for s in seqs)
        x = torch.zeros(len(seqs), length, device=self.positions.device)
        keep = torch.zeros(len(seqs), length, dtype=torch.bool, device=x.device)
        for i, s in enumerate(seqs):
            x[i, : len(s)] = s
            keep[i, : len(s)] = True
        h = self.drop(self.embed(x.unsqueeze(-1)) + self.positions[:length])
        b, n, d = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        att = self.drop(att.masked_fill(~keep[:, None, None, :], float("-inf")).softmax(-1))
        h = self.norm1(h + self.drop(self.proj((att @ v).transpose(1, 2).reshape(b, n, d))))
        h = self.norm(self.norm2(h + self.drop(self.ff(h)))) * keep.unsqueeze(-1)
        return h.sum(1) / keep.sum(1, keepdim=True)


class GatedGNN(nn.Module):
    """Node states updated by a GRU, node by node, in one forward sweep (messages from predecessors) and one
    backward sweep (from successors). A message sums an MLP of the one-hop neighbours' states and an MLP of every
    virtual-edge neighbour's state divided by its path length."""

    def __init__(self, hid: int):
        super().__init__()
        self.near = _mlp(hid, hid // 2, hid)
        self.far = _mlp(hid, hid // 2, hid)
        self.gru = nn.GRUCell(hid, hid)

    def forward(self, h: torch.Tensor, edges: list[tuple[int, int, int]]) -> torch.Tensor:
        n = h.shape[0]
        into = [[] for _ in range(n)]
        outof = [[] for _ in range(n)]
        for s, d, k in edges:
            into[d].append((s, k))
            outof[s].append((d, k))
        rows = list(h)
        for order, nbrs in ((range(n), into), (reversed(range(n)), outof)):
            for i in order:
                if not nbrs[i]:
                    continue
                dist = torch.tensor([float(k) for _, k in nbrs[i]], device=h.device)
                states = torch.stack([rows[j] for j, _ in nbrs[i]])
                msg = (self.far(states) / dist.unsqueeze(1)).sum(0)
                if bool((dist == 1).any()):
                    msg = msg + self.near(states[dist == 1]).sum(0)
                rows[i] = self.gru(msg.unsqueeze(0), rows[i].unsqueeze(0)).squeeze(0)
        return torch.stack(rows)


def _bucket(size: int) -> int:
    """A channel count's embedding index: its log2 bucket (1, 2, 3-4, 5-8, ...), at most 15."""
    return min(15, max(0, math.ceil(math.log2(max(size, 1)))) + 1)


class GraphHyperNetwork(nn.Module):
    """The hypernetwork over `models` (name -> nn.Module; their graphs, `ModelGraph.of`): `forward(name,
    last, histogram)` generates that model's trainable tensors (all but BN biases) for a client whose last
    uploaded tensors are `last` and whose label histogram is `histogram`. `classifier`: the (weight, bias)
    names of the models' classifier."""

    def __init__(self, models: dict[str, nn.Module], classifier: tuple[str, str | None], num_classes: int,
                 hid: int = 128, ve_cutoff: int = 50):
        super().__init__()
        self.graphs = {k: ModelGraph.of(m, ve_cutoff) for k, m in models.items()}
        self.classifier = tuple(c for c in classifier if c)
        self.type_embed = nn.Embedding(len(NODE_TYPES), hid)
        self.channel_embed = nn.Embedding(17, hid // 4)
        self.kernel_embed = nn.Embedding(17, hid // 4)
        self.summary = SummaryEncoder(hid)
        self.client = _mlp(num_classes, hid, 2 * hid, last_relu=False)
        self.gnn = GatedGNN(hid)
        self.norm = nn.LayerNorm(hid)
        # each type's (and each classifier tensor's) element-wise largest shape over every model
        largest: dict[str, list[int]] = {}
        for g in self.graphs.values():
            for kind, p, shape in zip(g.types, g.params, g.shapes):
                if p is None:
                    continue
                key = self._key(kind, p)
                old = largest.setdefault(key, list(shape))
                if len(old) != len(shape):
                    raise ConfigError("model", f"recipfl: {p} has {len(shape)} dims, other {kind} tensors {len(old)}")
                largest[key] = [max(a, b) for a, b in zip(old, shape)]
        self.largest = {k: tuple(v) for k, v in largest.items()}
        self.decoders = nn.ModuleDict({k: _mlp(hid, 2 * hid, math.prod(s), last_relu=False)
                                       for k, s in self.largest.items() if not k.startswith("cls:")})
        for g in self.graphs.values():   # a kind only the classifier has (ResNet-18's linear, bias): its first layer
            for kind, p in zip(g.types, g.params):
                if p in self.classifier and kind not in self.decoders:
                    self.decoders[kind] = nn.Sequential(nn.Linear(hid, 2 * hid))
        self.heads = nn.ModuleDict({_head_key(k): nn.Sequential(nn.ReLU(), nn.Linear(2 * hid, math.prod(s)))
                                    for k, s in self.largest.items() if k.startswith("cls:")})

    def _key(self, kind: str, param: str) -> str:
        return f"cls:{param}" if param in self.classifier else kind

    def node_states(self, name: str, last: dict[str, torch.Tensor]) -> torch.Tensor:
        """The graph's node states after the GNN, for the client's last tensors `last`."""
        g = self.graphs[name]
        device = self.type_embed.weight.device
        h = self.type_embed(torch.tensor([NODE_TYPES.index(t) for t in g.types], device=device))
        dims = [(tuple(s) + (1, 1, 1))[:4] if s else (0, 0, 0, 0) for s in g.shapes]
        ch = torch.tensor([[_bucket(d[0]), _bucket(d[1])] if s else [0, 0] for d, s in zip(dims, g.shapes)],
                          device=device)
        ks = torch.tensor([[min(16, d[2]), min(16, d[3])] if s else [0, 0] for d, s in zip(dims, g.shapes)],
                          device=device)
        h = h + torch.cat([self.channel_embed(ch[:, 0]), self.channel_embed(ch[:, 1]),
                           self.kernel_embed(ks[:, 0]), self.kernel_embed(ks[:, 1])], 1)
        held = [i for i, p in enumerate(g.params) if p is not None]
        enc = self.summary([summarize(last[g.params[i]]).to(device) for i in held])
        h = h.index_add(0, torch.tensor(held, device=device), enc)
        return self.norm(self.gnn(h, g.edges))

    def forward(self, name: str, last: dict[str, torch.Tensor], histogram: torch.Tensor) -> dict[str, torch.Tensor]:
        g = self.graphs[name]
        h = self.node_states(name, last)
        client = self.client(histogram.to(h.device).float().unsqueeze(0)).squeeze(0)
        out = {}
        for i, (kind, p, shape) in enumerate(zip(g.types, g.params, g.shapes)):
            if p is None:
                continue
            key = self._key(kind, p)
            if key.startswith("cls:"):   # the decoder's first layer, the client's label mix, the tensor's own head
                first = self.decoders[kind][0]
                w = self.heads[_head_key(key)](first(h[i]) + client)
            else:
                w = self.decoders[key](h[i])
            w = w.view(self.largest[key])[tuple(slice(0, s) for s in shape)]   # the corner of the largest shape
            out[p] = _fan_in(w, kind)
        return out


def _head_key(key: str) -> str:
    return key.replace(".", "@")   # ModuleDict keys cannot hold dots


def _fan_in(w: torch.Tensor, kind: str) -> torch.Tensor:
    """GHN-2's normalisation of a generated tensor: weights by sqrt(gain / fan-in) (gain 1 where no ReLU is
    expected to follow: a one-input-channel or wider-than-tall kernel; else 2), BN weights into (0, 2), biases
    into (-1, 1)."""
    if w.dim() > 1:
        no_relu = w.dim() > 2 and (w.shape[1] == 1 or w.shape[2] < w.shape[3])
        return w * math.sqrt((1.0 if no_relu else 2.0) / w[0].numel())
    if kind == "bn":
        return 2 * torch.sigmoid(0.5 * w)
    return torch.tanh(0.2 * w)

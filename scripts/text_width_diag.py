"""Why a width slice of MiniLM fails or a level drifts (docs/text.md, "Width methods on text: diagnosis").

    python scripts/text_width_diag.py pretrained [scaler=true|false]   # HeteroFL slices of the pretrained model
    python scripts/text_width_diag.py RUN_DIR                          # each level of a run's checkpoint
    python scripts/text_width_diag.py kept                             # what a width slice holds of the budget

`pretrained`: per level, the width slice of the pretrained MiniLM (32 tokens, word embeddings whole) as it is
evaluated (no scaler) and as it trains (HeteroFL's scaler folded in): a linear probe on its mean-pooled
features, the cosine between the two functions' features, and how large each sublayer's output is against
the residual stream it joins (mean over tokens and layers of |dense output| / |residual input|).

`kept`: the budgeted coordinates (`word_embeddings=whole`) that MiniLM's width slice keeps at HeteroFL's rate
sqrt(level) for each level, and at the smallest slice there is (one head and one feed-forward unit per layer):
the residual stream and the position embeddings are never cut, so that is the least any width slice holds.

`RUN_DIR`: per level of the checkpoint, as the engine evaluates it (static statistics of the head norm
recomputed for the level): global accuracy, test texts per predicted class, recall per class, the class mix of
the level's own clients' training texts, the std of the logits over texts,
the pooled features' norm before and after the head norm, a linear probe on the pooled features; the global
accuracy of the same level run with its training scales (the function its clients trained); and its global
accuracy with the head norm's statistics taken from the test set itself (static BN statistics ruled in or out)."""
from __future__ import annotations

import sys
import types

import torch
from text_linear_probe import linear_probe, pooled  # scripts/ is on sys.path when run as a script
from torch.func import functional_call

LEVELS = [1.0, 1 / 4, 1 / 16, 1 / 64]


class SublayerRatio:
    """Forward hooks on every BertSelfOutput / BertOutput: |dense(h)| / |residual input| per token."""

    def __init__(self, model):
        self.ratios = {"attention": [], "ffn": []}
        self.handles = []
        for layer in model.backbone.encoder.layer:
            for kind, mod in (("attention", layer.attention.output), ("ffn", layer.output)):
                self.handles.append(mod.register_forward_hook(self._hook(kind, mod)))

    def _hook(self, kind, mod):
        def hook(module, args, out):
            hidden, residual = args[0], args[1]
            self.ratios[kind].append(float((module.dense(hidden).norm(dim=-1) / residual.norm(dim=-1)).mean()))
        return hook

    def mean(self, kind):
        return sum(self.ratios[kind]) / max(1, len(self.ratios[kind]))

    def close(self):
        for h in self.handles:
            h.remove()


def pretrained(scaler: bool = True) -> None:
    from fedlase.data import text as textdata
    from fedlase.methods.heterofl import HeteroFL
    from fedlase.models.transformer import build_minilm
    torch.set_num_threads(1)
    cfg = types.SimpleNamespace(model="minilm", max_length=32, seed=0, word_embeddings="whole")
    ds = textdata.load_bbc_news(cfg)
    model = build_minilm(cfg, ds).eval()
    params = {n: p.detach() for n, p in model.named_parameters()}
    method = HeteroFL(model, LEVELS, scaler=scaler)
    pick = torch.randperm(len(ds.y_train), generator=torch.Generator().manual_seed(0))[:600]
    print(f"HeteroFL slices of the pretrained MiniLM, scaler={scaler}")
    print("| level | function | linear probe | cos(eval, train) features | attention out / residual | "
          "FFN out / residual |\n|---|---|---|---|---|---|")
    for level in LEVELS:
        sub = method.submodel(params, level, 1).masked()
        feats = {}
        for mode in ("eval", "train"):
            ratio = SublayerRatio(model)
            w = sub.apply(params, train=mode == "train")
            f_train, f_test = pooled(model, w, ds.x_train[pick]), pooled(model, w, ds.x_test)
            ratio.close()
            feats[mode] = f_test
            acc = linear_probe(f_train, ds.y_train[pick], f_test, ds.y_test, ds.num_classes)
            cos = float(torch.nn.functional.cosine_similarity(feats["eval"], f_test, dim=1).mean())
            print(f"| {level:g} | {mode} | {100 * acc:.1f}% | {cos:.3f} | {ratio.mean('attention'):.3f} | "
                  f"{ratio.mean('ffn'):.3f} |", flush=True)


def kept() -> None:
    from fedlase.levels import level_name
    from fedlase.masks import Submodel
    from fedlase.model_facts import ModelFacts
    from fedlase.models.transformer import build_minilm
    from fedlase.slicing import width_rate, width_slices
    model = build_minilm(types.SimpleNamespace(model="minilm", max_length=32, seed=0, word_embeddings="whole"),
                         types.SimpleNamespace(num_classes=5))
    params = {n: p.detach() for n, p in model.named_parameters()}
    names = model.budgeted_names()
    budget = sum(params[n].numel() for n in names)
    print(f"MiniLM, word_embeddings=whole: {budget:,} budgeted coordinates\n"
          "| slice | width rate | kept | kept / budget | kept / the level's budget |\n|---|---|---|---|---|")
    for name, level, rate in [*((f"level {level_name(lv)}", lv, width_rate(lv)) for lv in LEVELS[1:]),
                              ("smallest (1 head, 1 unit)", LEVELS[-1], 1e-9)]:
        k = Submodel(width_slices(ModelFacts(model), params, rate)[0]).kept(names, params)
        print(f"| {name} | {rate:.4g} | {k:,} | 1/{budget / k:.1f} | {k / (level * budget):.1f}x |")


def trained(run_dir: str) -> None:
    from fedlase import checkpoint
    from fedlase.catalog import load_builtins
    from fedlase.config import config_from_dict
    from fedlase.engine import Experiment
    from fedlase.evaluate import recompute_bn_stats
    load_builtins()
    state = checkpoint.load(f"{run_dir}/checkpoint.pt")   # weights-only
    exp = Experiment.from_config(config_from_dict(state["config"]))
    exp.load_state_dict(state)
    model, params, buffers = exp.model.eval(), exp.state.params, exp.state.buffers
    bn_x, bs = exp.x_train[exp.eval_data.bn_sample], exp.eval_settings.batch
    pick = torch.randperm(len(exp.y_train), generator=torch.Generator().manual_seed(0))[:600]
    classes = int(exp.y_test.max()) + 1
    seen = {}
    hooks = [model.classifier.register_forward_hook(lambda m, a, o: seen.__setitem__("logits", o))]
    if model.norm is not None:
        hooks.append(model.norm.register_forward_hook(lambda m, a, o: seen.update(before=a[0], after=o)))
    print(f"{run_dir}, round {exp.round}, method {exp.cfg.method} {exp.cfg.method_args}")
    print("| level | global acc | test texts per predicted class | recall per class (%) | the level's clients' "
          "training texts per class | logit std over texts | |features| before / after head norm | linear probe | "
          "global acc with training scales | global acc, head-norm statistics from the test set |\n"
          "|---|---|---|---|---|---|---|---|---|---|")

    def run(w, stats_x):
        """Logits and the head norm's input and output on the test set, its statistics recomputed on stats_x."""
        bufs = recompute_bn_stats(model, w, buffers, stats_x, bs)
        model.eval()   # recompute_bn_stats leaves the BN layers in training mode
        out = {"logits": [], "before": [], "after": []}
        with torch.no_grad():
            for i in range(0, len(exp.x_test), bs):
                functional_call(model, (w, bufs), (exp.x_test[i:i + bs],))
                for k in out:
                    out[k].append(seen.get(k, seen["logits"]))
        return {k: torch.cat(v) for k, v in out.items()}

    def acc(logits):
        return f"{100 * float((logits.argmax(1) == exp.y_test).float().mean()):.1f}%"

    for level in exp.levels:
        sub = exp.method.eval_submodel(params, level, exp.round).masked()
        evaluated = sub.apply(params)
        main = run(evaluated, bn_x)
        scaled = acc(run(sub.apply(params, train=True), bn_x)["logits"]) if sub.scales else "(no scales)"
        oracle = acc(run(evaluated, exp.x_test)["logits"]) if model.norm is not None else "(no head norm)"
        logits, before, after = main["logits"], main["before"], main["after"]
        pred = logits.argmax(1)
        counts = torch.bincount(pred, minlength=classes).tolist()
        recall = [round(100 * float((pred[exp.y_test == k] == k).float().mean())) for k in range(classes)]
        own = torch.cat([torch.as_tensor(exp.client_train[c]) for c in exp.level_clients[level]])
        trained_on = torch.bincount(exp.y_train[own], minlength=classes).tolist()
        f_train, f_test = pooled(model, evaluated, exp.x_train[pick]), pooled(model, evaluated, exp.x_test)
        probe = linear_probe(f_train, exp.y_train[pick], f_test, exp.y_test, classes)
        print(f"| {level.name} | {acc(logits)} | {counts} | {recall} | {trained_on} | "
              f"{float(logits.std(0).mean()):.3f} | {float(before.norm(dim=1).mean()):.2f} / "
              f"{float(after.norm(dim=1).mean()):.2f} | {100 * probe:.1f}% | {scaled} | {oracle} |", flush=True)
    for h in hooks:
        h.remove()


if __name__ == "__main__":
    if sys.argv[1:2] == ["kept"]:
        kept()
    elif len(sys.argv) > 1 and sys.argv[1] != "pretrained":
        trained(sys.argv[1])
    else:
        arg = sys.argv[2] if len(sys.argv) > 2 else "scaler=true"
        pretrained(arg.split("=", 1)[1].lower() in ("true", "1", "yes"))

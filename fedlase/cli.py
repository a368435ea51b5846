"""Command line: `fedlase run [CONFIG] [key=value ...]`, `fedlase sweep`, `fedlase report`, `fedlase evaluate`,
`fedlase export`, `fedlase methods`, `fedlase bench`, `fedlase convert-checkpoint`."""
from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path

from .config import options
from .errors import UserError


def format_table(final: dict) -> str:
    """The per-level result table printed at the end of a run (task=lm: accuracy is the next token's, and the
    perplexities follow)."""
    ppl = "global_ppl" in final
    extra = f"  {'local ppl':>10}  {'global ppl':>10}" if ppl else ""
    rows = [f"{'level':>6}  {'clients':>7}  {'local acc':>9}  {'global acc':>10}{extra}"]
    for name, v in [*final["levels"].items(), ("mean", {**final, "clients": ""})]:
        extra = f"  {v['local_ppl']:>10.2f}  {v['global_ppl']:>10.2f}" if ppl else ""
        rows.append(f"{name:>6}  {v['clients']:>7}  {100 * v['local_acc']:>8.2f}%  {100 * v['global_acc']:>9.2f}%"
                    f"{extra}")
    return "\n".join(rows)


def _cmd_run(args) -> int:
    from .config import load_config
    from .dispatch import run_config
    cfg = load_config(args.config, args.overrides)
    summary = run_config(cfg, resume=args.resume, progress=not args.quiet)
    print(f"\n{cfg.method} on {cfg.dataset}, system {cfg.system}, {summary['rounds']} rounds "
          f"({summary['train_time']:.0f} s of training); outputs in {cfg.out}")
    if "stopped" in summary:
        print(f"stopped: {summary['stopped']}")
    if "epsilon" in summary["final"]:
        print(f"epsilon {summary['final']['epsilon']:.4g} at delta {summary['final']['dp']['delta']:g}")
    print(format_table(summary["final"]))
    return 0


def _cmd_evaluate(args) -> int:
    import json

    from .engine import evaluate_run
    res = evaluate_run(args.run, args.overrides)
    print(f"{args.run}: round {res['round']}" + (f" ({' '.join(args.overrides)})" if args.overrides else ""))
    print(format_table(res))
    if args.json:
        from pathlib import Path
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


def _cmd_export(args) -> int:
    from .config import parse_override
    given = dict(parse_override(item) for item in args.overrides)
    unknown = set(given) - {"out", "level"}
    if unknown or "out" not in given:
        raise UserError(f"{sorted(unknown)[0] if unknown else 'out'}: export takes out=DIR (required) and level=NAME")
    from .llm.export import export_run
    folder = export_run(args.run, given["out"], None if given.get("level") is None else str(given["level"]))
    print(f"{args.run}: adapter written to {folder} (adapter_config.json, adapter_model.safetensors)")
    return 0


def _cmd_convert(args) -> int:
    from .checkpoint import convert
    for path in args.checkpoints:
        convert(path)
        print(f"{path}: rewritten as plain data")
    return 0


def _cmd_sweep(args) -> int:
    from .sweep import run_sweep
    from .sweep_plan import describe_plan, plan_sweep
    if args.dry_run:
        print(describe_plan(*plan_sweep(args.sweep)))
        return 0
    try:
        res = run_sweep(args.sweep, progress=not args.quiet, jobs=args.jobs, ray=args.ray)
    except KeyboardInterrupt:
        print("fedlase: sweep interrupted; run the same command again to resume it", file=sys.stderr)
        return 130
    print(f"sweep: {len(res['done'])} run(s) finished, {len(res['skipped'])} already done, "
          f"{len(res['failed'])} failed")
    for name in res["failed"]:
        print(f"  failed: {name} (see its error.txt)")
    return 1 if res["failed"] else 0


def _cmd_report(args) -> int:
    from .report import make_report
    bad = [t for t in args.target or [] if not 0 < t <= 100]
    if bad:
        raise UserError(f"report: --target takes global accuracies in percent, in (0, 100]; got {bad[0]:g}")
    targets = [t / 100 for t in args.target] if args.target else None
    path = make_report(args.dirs, args.out, args.group_by, args.paired_against, cost=not args.no_cost,
                       targets=targets)
    print(f"report written to {path} (tables as CSV and plots next to it)")
    return 0


def _bench(argv: list[str]) -> int:
    """`fedlase bench ARGS` runs the benchmark of a source checkout, tools/bench.py beside the package (a tool,
    not part of the library: an installed fedlase without its checkout has none), as its docs say to run it:
    `python -m tools.bench ARGS` in the checkout, in a process of its own. Its own parser reads ARGS."""
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    if not (root / "tools" / "bench.py").is_file():
        print("fedlase: error: bench: the benchmark is tools/bench.py of fedlase's source checkout; run "
              "`python -m tools.bench` there", file=sys.stderr)
        return 2
    return subprocess.run([sys.executable, "-m", "tools.bench", *argv], cwd=root).returncode


def _cmd_cost(args) -> int:
    from .config import load_config
    from .cost import LEGEND, format_cost_table
    from .measure import cost_table
    cfg = load_config(args.config, args.overrides)
    costs = cost_table(cfg, memory=not args.no_memory, checkpoint=args.checkpoint)
    print(format_cost_table(costs, cfg.method) + "\n\ncolumns:\n" + LEGEND)
    if cfg.device_model is not None or cfg.population is not None:   # the population: its spread per level
        from .simtime import time_spread_table
        print("\n" + time_spread_table(cfg, costs))
    return 0


def _cmd_methods(args) -> int:
    from .config import parse_override
    from .registry import import_plugins
    plugins = list(args.plugins or [])
    for item in args.overrides:   # `fedlase methods 'plugins=[my_methods]'`, as `fedlase run` writes it
        key, value = parse_override(item)
        if key != "plugins":
            raise UserError(f"{key}: `fedlase methods` takes only plugins=[...] (the modules whose methods to list)")
        plugins += value if isinstance(value, list) else [value]
    import_plugins(plugins)
    if args.readme:
        from .catalog import write_readme_table
        changed = write_readme_table(args.readme)
        print(f"{args.readme}: method table {'updated' if changed else 'already up to date'}")
    elif args.markdown:
        from .catalog import method_table
        print(method_table())
    else:
        from .methods import describe_methods
        print(describe_methods())
    return 0


class _Parser(argparse.ArgumentParser):
    """An epilog may be a function, called only when the help is printed: listing the registered choices
    loads the built-ins (torch and all), which `fedlase --help` and every other command line must not pay."""

    def format_help(self) -> str:
        if callable(self.epilog):
            self.epilog = self.epilog()
        return super().format_help()


def _keys_with_choices() -> str:
    from .catalog import load_builtins
    load_builtins()
    return "config keys:\n" + describe_keys()


SETTING = re.compile(r"[A-Za-z_][\w.]*=")   # key=value (a path such as runs/sweep/seed=1 is none)


def _settings_anywhere(args, extras: list[str], parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Settings and flags in any order: argparse hands a key=value that follows a flag back unparsed (`extras`),
    so every command that takes settings collects them here, wherever they stand; its one other word (the config
    file, the run folder) is the first that is no setting. A flag named like a config key (`--rounds 5`, in
    `argv`, the command line) is answered with the setting it meant."""
    for word in extras:
        if not word.startswith("-"):
            continue
        key, eq, value = word.lstrip("-").partition("=")
        key = key.replace("-", "_")
        if key.split(".")[0] in options():
            if not eq:   # its value: the word after it (argparse may have taken it for the config file)
                after = argv[argv.index(word) + 1:][:1]
                value = after[0] if after and not after[0].startswith("-") else "VALUE"
            raise UserError(f"{key}: settings are written key=value, not as flags: write {key}={value}")
        parser.error(f"unrecognized arguments: {' '.join(w for w in extras if w.startswith('-'))}")
    if not hasattr(args, "overrides"):
        if extras:
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        return
    head = "run" if hasattr(args, "run") else "config" if hasattr(args, "config") else None
    words = [w for w in [getattr(args, head, None) if head else None, *args.overrides, *extras] if w is not None]
    settings = [w for w in words if SETTING.match(w)]
    others = [w for w in words if not SETTING.match(w)]
    for w in others:
        if w.split(".")[0] in options() and not Path(w).exists():   # `rounds` alone: a setting without its value
            from .config import parse_override
            parse_override(w)
    if len(others) > (1 if head else 0):
        what = {"run": "one run folder", "config": "one config file"}.get(head, "only key=value settings")
        raise UserError(f"{args.command} takes {what} and key=value settings; "
                        f"{' and '.join(map(repr, others))} are not settings")
    if head:
        setattr(args, head, others[0] if others else None)
        if head == "run" and not others:
            parser.error("the following arguments are required: run")
    args.overrides = settings


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    parser = _Parser(
        prog="fedlase", description="System-heterogeneous federated learning by submodel extraction.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys of `fedlase run` (`fedlase run --help` also lists the methods, datasets, models and "
               "partitions; `fedlase methods` lists each method's options):\n" + describe_keys(choices=False))
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="run one experiment", formatter_class=argparse.RawDescriptionHelpFormatter,
                         description="Run one experiment from a YAML config and/or key=value overrides "
                                     "(overrides win; nested keys with dots: method_args.score=max). Settings "
                                     "and flags may come in any order.",
                         epilog=_keys_with_choices)
    run.add_argument("config", nargs="?", help="YAML config file (optional; before, after or among the settings)")
    run.add_argument("overrides", nargs="*", help="key=value settings")
    run.add_argument("--resume", action="store_true", help="continue the run in `out` from its last checkpoint")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.set_defaults(func=_cmd_run)
    ev = sub.add_parser("evaluate", help="evaluate a run's checkpoint again, e.g. under another eval_order",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        description="Evaluate the model in a run folder's checkpoint.pt again and print the per-level "
                                    "table.\nOnly the evaluation settings below may change, and plugins=[...], the "
                                    "modules to import (fedlase imports none that a run folder names).\nThe "
                                    "checkpoint is read as data only: one holding anything but tensors and plain "
                                    "values is refused.",
                        epilog=lambda: "evaluation settings (key=value):\n" + describe_keys(keys=_evaluate_keys()))
    ev.add_argument("run", help="run folder (holds checkpoint.pt)")
    ev.add_argument("overrides", nargs="*", help="key=value evaluation settings")
    ev.add_argument("--json", metavar="FILE", help="also write the evaluation as JSON to FILE")
    ev.set_defaults(func=_cmd_evaluate)
    exp = sub.add_parser("export", help="write a LoRA run's adapter as a peft folder (docs/llm.md, Export)",
                         description="Write the adapter of a LoRA run's checkpoint as adapter_config.json and "
                                     "adapter_model.safetensors, which peft.PeftModel.from_pretrained loads on the "
                                     "run's base transformer (and head.safetensors: a classifier head outside it). "
                                     "level=NAME: that level's adapter (its rank); default the largest level's.")
    exp.add_argument("run", help="run folder (holds checkpoint.pt)")
    exp.add_argument("overrides", nargs="*", metavar="settings", help="out=DIR (required), level=NAME")
    exp.set_defaults(func=_cmd_export)
    conv = sub.add_parser("convert-checkpoint", help="rewrite a checkpoint.pt of an older fedlase as plain data "
                          "(only for files you trust: reading the old layout runs whatever the file holds)")
    conv.add_argument("checkpoints", nargs="+", metavar="FILE", help="checkpoint.pt files to rewrite in place")
    conv.set_defaults(func=_cmd_convert)
    meth = sub.add_parser("methods", help="list methods and their method_args options",
                          description="List the registered methods (built-in, installed, and those of the plug-in "
                                      "modules named by plugins=[...] or --plugins) and their method_args options.")
    meth.add_argument("overrides", nargs="*", metavar="plugins=[...]", help="plug-in modules whose methods to list "
                      "too, as `fedlase run` takes them")
    meth.add_argument("--plugins", nargs="+", metavar="MODULE", help="the same as plugins=[MODULE, ...]")
    meth.add_argument("--markdown", action="store_true", help="the built-in methods as README.md's Markdown table")
    meth.add_argument("--readme", metavar="FILE", help="rewrite the method table between FILE's marker lines "
                      "(README.md; tests/test_structure.py checks it is current)")
    meth.set_defaults(func=_cmd_methods)
    # listed for the help only: main() hands `fedlase bench ...` to tools/bench.py before parsing
    sub.add_parser("bench", add_help=False, help="time and memory of the engine against the limit "
                   "(tools/bench.py of a source checkout; `fedlase bench --help`; docs/benchmarks.md)")
    sw = sub.add_parser("sweep", help="run a grid of experiments, skipping finished runs and resuming others",
                        description="Run every experiment of a sweep file (base:, grid:, runs:, out:; see "
                                    "docs/analysis.md). Rerun the same command to resume.")
    sw.add_argument("sweep", help="sweep YAML file")
    sw.add_argument("--dry-run", action="store_true", help="validate every run and list them; start nothing")
    sw.add_argument("--quiet", action="store_true", help="no progress bars")
    sw.add_argument("--jobs", type=int, default=1, metavar="N", help="runs at once, each in its own process with "
                    "cores/N torch threads unless the sweep sets threads [default: 1]")
    sw.add_argument("--ray", metavar="ADDRESS", help="run each unfinished run as a task on the running Ray cluster "
                    "at ADDRESS (host:port of its head, or auto); `out` must be shared by every node "
                    "(docs/cluster.md)")
    sw.set_defaults(func=_cmd_sweep)
    cost = sub.add_parser("cost", help="what each level costs a client: parameters held, measured peak memory, "
                          "step FLOPs (dense and if sparsity were exploited), payload bytes (fedlase/cost.py)")
    cost.add_argument("config", nargs="?", help="YAML config file (optional; before, after or among the settings)")
    cost.add_argument("overrides", nargs="*", help="key=value settings")
    cost.add_argument("--no-memory", action="store_true", help="skip the measured peak memory (a child process "
                      "per level)")
    cost.add_argument("--checkpoint", metavar="FILE", help="take the submodels from this checkpoint.pt's model "
                      "instead of the initial one")
    cost.set_defaults(func=_cmd_cost)
    rep = sub.add_parser("report", help="tables (Markdown, CSV) and plots from finished runs",
                         description="Collect runs (folders holding summary.json, searched recursively) into "
                                     "tables and plots; runs differing only by seed are one group (mean ± std).")
    rep.add_argument("dirs", nargs="+", help="run or sweep folders")
    rep.add_argument("--out", default="report", help="folder for report.md, the CSV files and plots/ [default: report]")
    rep.add_argument("--group-by", nargs="+", metavar="KEY", help="group runs by these config keys only "
                     "(dotted, e.g. method method_args.score)")
    rep.add_argument("--paired-against", metavar="GROUP", help="compare every group with this one (its label as "
                     "the report's first table shows it), paired by seed: mean difference, t and p (and at equal "
                     "simulated time, when the runs have one)")
    rep.add_argument("--target", type=float, nargs="+", metavar="PCT", help="global accuracies (%%, mean over "
                     "levels) whose simulated times to reach are tabulated [default: the median of the groups' final "
                     "accuracies]")
    rep.add_argument("--no-cost", action="store_true", help="leave out the cost tables and the simulated time "
                     "(a group whose runs had no device_model or deadline has its parts rebuilt: its data and one "
                     "local step a level; the others recorded their costs in sim.json)")
    rep.set_defaults(func=_cmd_report)

    args, extras = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        _settings_anywhere(args, extras, sub.choices[args.command], argv)
        from .catalog import load_builtins
        load_builtins()   # every command sees the built-in and installed choices
        return args.func(args)
    except UserError as e:
        print(f"fedlase: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:   # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("fedlase: interrupted; rerun with --resume to continue from the last checkpoint", file=sys.stderr)
        return 130


def _evaluate_keys() -> tuple[str, ...]:
    """What `fedlase evaluate` takes (fedlase.engine.EVAL_KEYS: the keys tagged "eval"), and plugins."""
    from .config import tagged
    return (*tagged("eval"), "plugins")


def describe_keys(choices: bool = True, keys=None) -> str:
    """Help text for every config key (or those in `keys`), for the CLI; `choices`: also list the registered
    methods, datasets, models and partitions (registered by then: fedlase.catalog.load_builtins())."""
    lines = []
    for name, opt in options().items():
        if keys is not None and name not in keys:
            continue
        listed = opt.allowed() if choices and callable(opt.choices) else None   # a registry's names
        names = f" ({', '.join(map(str, listed))})" if listed else ""
        lines.append(f"  {name:<18} {opt.help}{names} [default: {opt.default}]")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

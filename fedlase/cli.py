"""Command line: `fedlase run [CONFIG] [key=value ...]`, `fedlase methods`."""
from __future__ import annotations

import argparse
import logging
import sys

from .config import describe_keys
from .errors import UserError


def format_table(final: dict) -> str:
    """The per-level result table printed at the end of a run."""
    rows = [f"{'level':>6}  {'clients':>7}  {'local acc':>9}  {'global acc':>10}"]
    for lvl, v in final["levels"].items():
        rows.append(f"{lvl:>6}  {v['clients']:>7}  {100 * v['local_acc']:>8.2f}%  {100 * v['global_acc']:>9.2f}%")
    rows.append(f"{'mean':>6}  {'':>7}  {100 * final['local_acc']:>8.2f}%  {100 * final['global_acc']:>9.2f}%")
    return "\n".join(rows)


def _cmd_run(args) -> int:
    from .config import load_config
    from .engine import run_experiment
    cfg = load_config(args.config, args.overrides)
    summary = run_experiment(cfg, resume=args.resume, progress=not args.quiet)
    print(f"\n{cfg.method} on {cfg.dataset}, system {cfg.system}, {cfg.rounds} rounds "
          f"({summary['train_time']:.0f} s of training); outputs in {cfg.out}")
    print(format_table(summary["final"]))
    return 0


def _cmd_methods(args) -> int:
    from .methods import describe_methods
    print(describe_methods())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fedlase", description="System-heterogeneous federated learning by submodel extraction.",
        epilog="Run `fedlase run --help` for every config key, `fedlase methods` for each method's options.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one experiment", formatter_class=argparse.RawDescriptionHelpFormatter,
                         description="Run one experiment from a YAML config and/or key=value overrides "
                                     "(overrides win; nested keys with dots: method_args.score=max).",
                         epilog="config keys:\n" + describe_keys())
    run.add_argument("config", nargs="?", help="YAML config file (optional when the first argument is key=value)")
    run.add_argument("overrides", nargs="*", help="key=value settings")
    run.add_argument("--resume", action="store_true", help="continue the run in `out` from its last checkpoint")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.set_defaults(func=_cmd_run)
    meth = sub.add_parser("methods", help="list methods and their method_args options")
    meth.set_defaults(func=_cmd_methods)

    args = parser.parse_args(argv)
    if getattr(args, "config", None) and "=" in args.config:   # `fedlase run key=value ...` without a file
        args.overrides, args.config = [args.config, *args.overrides], None
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        return args.func(args)
    except UserError as e:
        print(f"fedlase: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedlase: interrupted; rerun with --resume to continue from the last checkpoint", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

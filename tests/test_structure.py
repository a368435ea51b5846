"""The package's import graph, read from the source: no import circle, and the engine names no method, no
analysis and no dataset or model module (it reaches them through fedlase.registry)."""
import ast
import functools
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "fedlase"


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """fedlase modules imported anywhere in the file (top level or inside functions)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("fedlase")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("fedlase"):
                continue
            for a in node.names:   # `from .data import text` imports the module fedlase.data.text
                sub = f"{target}.{a.name}"
                out.add(sub if (PKG.parent / sub.replace(".", "/")).with_suffix(".py").exists() else target)
    return out - {me}


@functools.lru_cache(maxsize=1)
def parsed() -> tuple[tuple[Path, ast.Module], ...]:
    """Every module of the package and its syntax tree, parsed once per session."""
    return tuple((p, ast.parse(p.read_text())) for p in sorted(PKG.rglob("*.py")))


@functools.lru_cache(maxsize=1)
def _graph() -> dict[str, frozenset[str]]:
    return {module_name(p): frozenset(imports(p)) for p in PKG.rglob("*.py")}


def graph() -> dict[str, set[str]]:
    """module -> the fedlase modules it imports; read once per session (a copy each call)."""
    return {m: set(names) for m, names in _graph().items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(g.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (c := visit(n)):
                return c
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(g):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_graph_is_read_correctly():
    g = graph()
    assert "fedlase.registry" in g["fedlase.engine"] and "fedlase.aggregate" in g["fedlase.engine"]
    assert "fedlase.methods.base" in g["fedlase.methods.fiarse"]


def test_no_import_cycle():
    assert find_cycle(graph()) is None, " -> ".join(find_cycle(graph()))


def test_a_cycle_would_be_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_engine_names_no_method_analysis_dataset_or_model():
    names = graph()["fedlase.engine"]
    banned = [m for m in names if m.startswith(("fedlase.methods", "fedlase.analysis", "fedlase.models",
                                                 "fedlase.data.sources", "fedlase.data.text", "fedlase.flower"))]
    assert not banned


def test_the_engine_imports_nothing_that_builds_on_it():
    """Not at module level, not inside a function: the simulated clock is built by the caller and handed in
    (fedlase/dispatch.py, Flower's ServerApp), and costs and reports take the engine's parts."""
    above = ("fedlase.simtime", "fedlase.cost", "fedlase.measure", "fedlase.report", "fedlase.sweep",
             "fedlase.flower")
    assert "fedlase.simtime" in imports(PKG / "dispatch.py")   # read inside a function too: the dispatcher's is there
    assert not [m for m in imports(PKG / "engine.py") if m.startswith(above)]


def test_only_the_command_line_imports_the_llm_package():
    """The language-model track plugs in through the registry (its models, task, methods and the `lora` adapters:
    fedlase.registry.ADAPTERS); a module below it that imported it would point up the layers."""
    users = {m for m, names in graph().items()
             if not m.startswith("fedlase.llm") and any(n.startswith("fedlase.llm") for n in names)}
    assert users <= {"fedlase.cli"}, users   # `fedlase export`


# Flower's and Ray's modules fedlase may use: their documented API, each module by its exact name (so a private
# module without an underscore fails too, not only `flwr.*._*`).
PUBLIC = {"flwr.app", "flwr.clientapp", "flwr.serverapp", "flwr.simulation",
          "ray", "ray.exceptions", "ray.util.scheduling_strategies", "grpc"}
# Used although not documented API, because Flower or Ray offers none; the line must carry its reason (a comment
# there, the full one beside it) and pyproject.toml pins the tested range (docs/flower.md, "Flower versions").
OUTSIDE = {"flwr.proto": "fedlase/flower/proxy.py",                  # the Fleet API's routes
           "ray._private.ray_constants": "fedlase/flower/sim_engine.py",  # the loopback switch, after `import ray`
           "/ray.rpc.": "fedlase/cluster.py"}                        # is this port a Ray head, in seconds


def _third_party_uses(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every Flower/Ray/gRPC module the file imports, and of every string naming one."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.append((node.lineno, node.module or ""))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                (re.fullmatch(r"(flwr|ray|grpc)(\.\w+)+", node.value) or "/ray.rpc." in node.value):
            out.append((node.lineno, node.value))
    return [(ln, m) for ln, m in out if re.match(r"(flwr|ray|grpc)\b|/ray\.rpc\.", m)]


def test_only_the_named_flower_and_ray_modules_are_used():
    """Every Flower, Ray and gRPC module fedlase/ uses is in PUBLIC, or in OUTSIDE, from its one file, on a line
    that says why."""
    bad = []
    for p in sorted(PKG.rglob("*.py")):
        lines = p.read_text().splitlines()
        rel = str(p.relative_to(PKG.parent))
        for ln, name in _third_party_uses(p):
            if name in PUBLIC:
                continue
            where = next((f for m, f in OUTSIDE.items() if name == m or (m.startswith("/") and m in name)), None)
            if where != rel or "#" not in lines[ln - 1]:
                bad.append(f"{rel}:{ln}: {name}")
    assert not bad, bad


def test_the_module_check_catches_a_private_module_without_an_underscore(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from flwr.superlink.routers.fleet.router import router\nimport ray._raylet\nx = 'ray._private.w'\n")
    names = [m for _, m in _third_party_uses(f)]
    assert names == ["flwr.superlink.routers.fleet.router", "ray._raylet", "ray._private.w"]
    assert not set(names) & PUBLIC


# torch's private names fedlase uses, each from its one file, on a line that says why (torch has no public name).
TORCH_PRIVATE = {"nn.modules.batchnorm._BatchNorm": "fedlase/layers.py",
                 "nn.modules.dropout._DropoutNd": "fedlase/layers.py",
                 "nn.modules.conv._ConvNd": "fedlase/layers.py",
                 # the written-out SGD's one launch per operation (torch.optim's own foreach path, not exported)
                 "torch._foreach_add": "fedlase/train.py", "torch._foreach_add_": "fedlase/train.py",
                 "torch._foreach_mul_": "fedlase/train.py",
                 # torch.use_deterministic_algorithms without its import of inductor's config (1.2 s a process)
                 "torch._C": "fedlase/determinism.py",
                 # which layer's forward made the autograd node a backward runs: the cost table's FLOPs per layer
                 "torch._C._current_autograd_node": "fedlase/cost.py"}


def _torch_private_uses(path: Path, tree: ast.Module | None = None) -> list[tuple[int, str]]:
    """(line, dotted name) of every private torch name the file uses: an attribute chain from `torch`, `nn` or
    `F` with a `_name` in it, or an import from such a module or of such a name."""
    out = []
    for node in ast.walk(tree or ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            parts, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                parts.insert(0, inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in ("torch", "nn", "F") and \
                    any(p.startswith("_") and not p.startswith("__") for p in parts):
                out.append((node.lineno, ".".join([inner.id, *parts])))
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
            mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            names = [f"{mods[0]}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else mods
            out += [(node.lineno, n) for n in names if n.split(".")[0] == "torch" and
                    any(p.startswith("_") and not p.startswith("__") for p in n.split("."))]
    # an inner chain (nn.modules.batchnorm) of a flagged one is the same use: keep the longest per line
    return [(ln, n) for ln, n in out if not any(m != n and m.startswith(n + ".") for l2, m in out if l2 == ln)]


def test_only_the_named_private_torch_names_are_used():
    bad = []
    for p, tree in parsed():
        lines = p.read_text().splitlines()
        rel = str(p.relative_to(PKG.parent))
        for ln, name in _torch_private_uses(p, tree):
            if TORCH_PRIVATE.get(name) != rel or "#" not in lines[ln - 1]:
                bad.append(f"{rel}:{ln}: {name}")
    assert not bad, bad


def test_the_torch_check_catches_private_names(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import torch\nfrom torch import nn\nfrom torch._C import x\nimport torch._dynamo\n"
                 "y = isinstance(m, nn.modules.batchnorm._BatchNorm)\nz = torch.utils._pytree.tree_map\n"
                 "ok = torch.__version__, nn.Linear\n")
    assert sorted(n for _, n in _torch_private_uses(f)) == ["nn.modules.batchnorm._BatchNorm", "torch._C.x",
                                                             "torch._dynamo", "torch.utils._pytree.tree_map"]


# ---- the config is a plain record low in the graph (issue 22) -------------------------------------------------

HEAVY = ("fedlase.methods", "fedlase.models", "fedlase.data", "fedlase.analysis", "fedlase.catalog")


def _heavy(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in HEAVY)


def _loaded_by(module: str) -> tuple[list[str], int]:
    """(fedlase modules a fresh interpreter holds after importing `module`, entries registered by then): one
    interpreter for both, as each start imports torch."""
    import subprocess
    import sys
    code = (f"import sys, {module}\nfrom fedlase.registry import DATASETS, METHODS, MODELS, PARTITIONS, TRACKERS\n"
            "print(' '.join(m for m in sys.modules if m.startswith('fedlase')))\n"
            "print(sum(len(r.names()) for r in (DATASETS, METHODS, MODELS, PARTITIONS, TRACKERS)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    modules, registered = proc.stdout.splitlines()
    return modules.split(), int(registered)


def test_importing_the_config_loads_no_method_model_or_dataset():
    loaded, _ = _loaded_by("fedlase.config")
    assert "fedlase.config" in loaded
    assert not [m for m in loaded if _heavy(m)], loaded


def test_importing_the_engine_loads_no_method_model_or_dataset_loader_and_registers_nothing():
    """The engine needs the partition and augmentation code only: no method, model, loader, analysis or catalog."""
    loaded, registered = _loaded_by("fedlase.engine")
    assert "fedlase.engine" in loaded
    allowed = {"fedlase.data", "fedlase.data.partition", "fedlase.data.augment"}
    assert not [m for m in loaded if _heavy(m) and m not in allowed], loaded
    assert registered == 0


def test_the_config_imports_nothing_above_it():
    """Its imports (and theirs) are the low layer: errors, levels, machine, options, registry, resources, util,
    and each area's config checks (data, deploy, method, robust, sim, and the language models' lora)."""
    g, seen, todo = graph(), set(), ["fedlase.config"]
    while todo:
        for n in g.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    assert seen <= {"fedlase", "fedlase.errors", "fedlase.levels", "fedlase.machine", "fedlase.options",
                    "fedlase.registry", "fedlase.resources", "fedlase.robust_config", "fedlase.sim_config",
                    "fedlase.data_config", "fedlase.deploy_config", "fedlase.method_config", "fedlase.util",
                    "fedlase.lora_config"}, seen
    assert not any(_heavy(m) for m in seen)


def test_only_the_edges_register_the_built_ins():
    """catalog (which imports every built-in) is imported by the programs' entry points only."""
    importers = {m for m, names in graph().items() if "fedlase.catalog" in names}
    assert importers <= {"fedlase", "fedlase.cli", "fedlase.api", "fedlase.dispatch", "fedlase.sweep",
                         "fedlase.flower.server_app", "fedlase.flower.client_app",
                         "fedlase.flower.proxy", "fedlase.measure"}, importers
    # proxy: `python -m fedlase.flower.proxy front --config`; measure: the child process of `fedlase cost`


def _registering_modules() -> set[str]:
    """Modules that call a register_* function or use one as a decorator (registry.py itself aside)."""
    out = set()
    for p, tree in parsed():
        for node in ast.walk(tree):
            f = node.func if isinstance(node, ast.Call) else node if isinstance(node, ast.Name) else None
            name = getattr(f, "id", None) or getattr(f, "attr", None) or ""
            if name.startswith("register_") and name != "register_buffer" and not name.endswith("_hook"):
                out.add(module_name(p))
    return out - {"fedlase.registry", "fedlase"}


def test_every_registering_module_is_in_a_choice_package():
    """fedlase.catalog imports the choice packages' modules, not a list: a module elsewhere would never register."""
    from fedlase.catalog import CHOICE_PACKAGES
    found = _registering_modules()
    assert {"fedlase.methods.fjord", "fedlase.models", "fedlase.data.builtins", "fedlase.analysis"} <= found
    assert not [m for m in found if not m.startswith(CHOICE_PACKAGES)], found


def test_every_built_in_method_class_is_registered():
    from fedlase.catalog import load_builtins
    from fedlase.methods import Method
    from fedlase.registry import METHODS
    load_builtins()
    named = [cls for cls in _subclasses(Method) if cls.__module__.startswith("fedlase.") and cls.name]
    assert len(named) >= 10 and all(METHODS.get(cls.name) is cls for cls in named), named


def _subclasses(cls) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def test_every_random_stream_tag_is_declared_once_in_stream():
    """Each `derive_seed(seed, round, TAG, ...)` in fedlase/ names a member of fedlase.sampling.Stream, and no two
    members share a value: two uses of one tag would draw correlated numbers, silently."""
    from fedlase.sampling import Stream
    tags = []
    for _, tree in parsed():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "derive_seed" and len(node.args) > 2:
                tag = node.args[2]
                tags.append(f"{tag.value.id}.{tag.attr}" if isinstance(tag, ast.Attribute) and
                            isinstance(tag.value, ast.Name) else ast.unparse(tag))
    assert len(tags) >= 5 and all(t.startswith("Stream.") for t in tags), tags
    assert {t.split(".")[1] for t in tags} == set(Stream.__members__)
    assert len({int(m) for m in Stream.__members__.values()}) == len(Stream.__members__)


# ---- the README's method table is the registry's (issue 29) ---------------------------------------------------

def test_readme_method_table_is_the_generated_one():
    """README.md's table between the markers equals fedlase.catalog.method_table(), so every built-in method is
    listed with its options; `fedlase methods --readme README.md` rewrites it."""
    from fedlase.catalog import method_table, readme_table
    from fedlase.registry import METHODS
    readme = (PKG.parent / "README.md").read_text()
    table = readme_table(readme)
    assert table is not None, "README.md lost the method table's markers"
    assert table == method_table(), "README.md's method table is out of date: run `fedlase methods --readme README.md`"
    builtins = [n for n, cls in METHODS.items() if cls.__module__.startswith("fedlase.")]
    assert len(builtins) >= 9 and all(f"| `{n}` |" in table for n in builtins)


@pytest.mark.flower
def test_the_proxys_fleet_routes_are_the_superlinks():
    """fedlase.flower.proxy derives the Fleet API's paths from Flower's wire protocol; the SuperLink's own router
    (Flower internals, fine in a test) must serve exactly those, or the proxy forwards the wrong set."""
    import pytest
    pytest.importorskip("flwr")
    from flwr.superlink.routers.fleet.router import router

    from fedlase.flower.proxy import fleet_routes
    assert fleet_routes() == sorted({r.path for r in router.routes})


def test_the_readme_command_rewrites_only_the_marked_table(tmp_path, capsys):
    from fedlase.catalog import TABLE_END, TABLE_START, method_table
    from fedlase.cli import main
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{TABLE_START}\n| stale |\n{TABLE_END}\nrest\n")
    assert main(["methods", "--readme", str(readme)]) == 0 and "updated" in capsys.readouterr().out
    assert readme.read_text() == f"intro\n{TABLE_START}\n{method_table()}\n{TABLE_END}\nrest\n"
    assert main(["methods", "--readme", str(readme)]) == 0 and "already up to date" in capsys.readouterr().out
    assert main(["methods", "--markdown"]) == 0 and capsys.readouterr().out.strip() == method_table()
    readme.write_text("no markers\n")
    assert main(["methods", "--readme", str(readme)]) == 2
    assert "no method table markers" in capsys.readouterr().err and readme.read_text() == "no markers\n"


# ---- hooks: declared on their base classes, called without probing ------------------------------------------
HOOK_CALLERS = ("evaluate.py", "client.py", "cost.py", "engine.py")
HOOK_HOLDERS = {"method", "runner", "local", "objective"}   # the names a method, runner or objective goes by


def hook_names() -> set[str]:
    from fedlase.engine import RoundRunner, SequentialRounds
    from fedlase.methods.base import LocalObjective, Method
    return {n for c in (Method, LocalObjective, RoundRunner, SequentialRounds) for n in dir(c)
            if not n.startswith("__")}


def probes(tree: ast.AST, hooks: set[str]) -> list[str]:
    """hasattr/getattr calls that ask a method, runner or objective (or anything, for a hook's name) whether it
    has an attribute: the hook should be declared with a default instead."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr") \
                and len(node.args) >= 2:
            obj, name = node.args[0], node.args[1]
            holder = obj.attr if isinstance(obj, ast.Attribute) else getattr(obj, "id", "")
            hook = isinstance(name, ast.Constant) and name.value in hooks
            if holder in HOOK_HOLDERS or hook:
                out.append(f"line {node.lineno}: {ast.unparse(node)}")
    return out


def test_no_hook_is_probed_with_hasattr_or_getattr():
    hooks = hook_names()
    assert {"personal_weights", "module_for", "global_eval", "held_params", "server_update", "params_for",
            "finish", "personal", "async_schedule"} <= hooks   # declared (methods/base.py, the engine's runners)
    found = {f: probes(ast.parse((PKG / f).read_text()), hooks) for f in HOOK_CALLERS}
    assert not any(found.values()), found


def test_the_probe_check_catches_a_probe():
    hooks = hook_names()
    for code in ('own = getattr(method, "personal_weights", None)', "x = hasattr(self.runner, 'anything')",
                 'getattr(sub.local, "personal", False)', 'hasattr(m, "module_for")'):
        assert probes(ast.parse(code), hooks), code
    assert not probes(ast.parse('getattr(cfg, "seed")'), hooks)


def test_every_method_hook_the_evaluation_calls_is_declared():
    from fedlase.methods.base import Method
    tree = ast.parse((PKG / "evaluate.py").read_text())
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "method"}
    assert {"personal_weights", "module_for", "held_params"} <= used
    assert all(hasattr(Method, a) for a in used), sorted(a for a in used if not hasattr(Method, a))


def _members_read(path: Path, holder: str) -> set[str]:
    """Every `<holder>.X` read in the file, where holder is a name (`exp`) or an attribute chain (`self.exp`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) == holder:
            out.add(node.attr)
    return out


def _declared(cls) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("__")} | set(getattr(cls, "__annotations__", {}))


def test_the_schedule_uses_only_its_server_port():
    """The event loop (and Flower's, which extends it) reaches the run only through `ServerPort`: no private
    member of the engine, nothing the port does not declare."""
    from fedlase.asynchronous import ServerPort
    port = _declared(ServerPort)
    assert _members_read(PKG / "asynchronous.py", "exp")   # the check reads something
    for path in (PKG / "asynchronous.py", PKG / "flower" / "buffered.py"):
        used = _members_read(path, "exp")
        assert used <= port, (path.name, sorted(used - port))


def test_trackers_read_the_run_through_a_read_only_view():
    from fedlase.engine import RunView
    view = {n for n in dir(RunView) if isinstance(getattr(RunView, n), property)}
    used = _members_read(PKG / "analysis.py", "self.exp")
    assert used and used <= view, sorted(used - view)
    with pytest.raises(AttributeError):   # a view has no setter: a tracker cannot replace what it reads
        RunView(None).cfg = None


def test_round_runners_use_only_their_port():
    """The embedded runners and Flower's read the run through `RunnerPort` only."""
    from fedlase.engine import RunnerPort
    port = _declared(RunnerPort)
    tree = ast.parse((PKG / "engine.py").read_text())
    runners = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in ("SequentialRounds", "BatchedRounds")]
    used = {a.attr for r in runners for a in ast.walk(r)
            if isinstance(a, ast.Attribute) and ast.unparse(a.value) == "exp"}
    used |= _members_read(PKG / "flower" / "rounds.py", "exp")
    assert used and used <= port, sorted(used - port)


def test_the_schedule_hands_on_a_runners_port_and_reads_only_its_clocks_members():
    """The loop hands its port to the runner (and Flower's to its nodes' messages), so the port declares what a
    runner reads; of the clock it reads only what `ScheduleClock` declares, the engine and the run folder only
    what the engine's `Clock` does."""
    from fedlase.asynchronous import ScheduleClock, ServerPort
    from fedlase.engine import Clock, RunnerPort
    assert _declared(RunnerPort) <= _declared(ServerPort), sorted(_declared(RunnerPort) - _declared(ServerPort))
    for path in (PKG / "asynchronous.py", PKG / "flower" / "buffered.py"):
        used = _members_read(path, "exp.clock")
        assert used <= _declared(ScheduleClock), (path.name, sorted(used - _declared(ScheduleClock)))
    used = _members_read(PKG / "engine.py", "self.clock") | _members_read(PKG / "run_dir.py", "exp.clock")
    assert used and used <= _declared(Clock), sorted(used - _declared(Clock))


def test_the_run_folder_uses_only_its_port():
    from fedlase.run_dir import FolderPort
    used = _members_read(PKG / "run_dir.py", "exp")
    assert used and used <= _declared(FolderPort), sorted(used - _declared(FolderPort))


def _experiment_class() -> ast.ClassDef:
    tree = ast.parse((PKG / "engine.py").read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Experiment")


def test_the_experiment_has_every_member_its_ports_declare():
    """What `__init__` sets (`self.x = ...`) and what the class defines cover RunnerPort, ServerPort, FolderPort
    and what RunView reads: a port cannot name what the engine's run does not have."""
    from fedlase.asynchronous import ServerPort
    from fedlase.engine import RunnerPort
    from fedlase.run_dir import FolderPort
    cls = _experiment_class()
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    has = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    has |= {t.attr for n in ast.walk(init) if isinstance(n, ast.Assign) for tgt in n.targets
            for t in ast.walk(tgt) if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"}
    wanted = {n for c in (RunnerPort, ServerPort, FolderPort) for n in _declared(c) if not n.startswith("_")}
    wanted |= _members_read(PKG / "engine.py", "self._exp")   # RunView's
    assert {"cfg", "params", "clock", "serve", "state"} <= wanted
    assert wanted <= has, sorted(wanted - has)


def _builds_in_init(cls: ast.ClassDef) -> list[str]:
    """Calls in the class's `__init__` that build the run's parts or call one of its arguments (a factory, such
    as a clock's, which can start child processes)."""
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = {a.arg for a in [*init.args.args, *init.args.kwonlyargs]} - {"self"}
    out = []
    for node in ast.walk(init):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name.split(".")[-1] in ("build_parts", "clock_for") or name in args:
                out.append(f"line {node.lineno}: {ast.unparse(node)}")
    return out


def test_the_experiment_is_handed_its_parts_and_clock():
    """`Experiment.__init__` builds no parts and calls no clock factory; `Experiment.from_config` does both."""
    cls = _experiment_class()
    assert not _builds_in_init(cls), _builds_in_init(cls)
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert [a.arg for a in init.args.args[:3]] == ["self", "cfg", "parts"] and len(init.args.defaults) == 2


def test_the_construction_check_catches_a_build_and_a_factory_call():
    old = ("class Experiment:\n    def __init__(self, cfg, runner=None, clock=None, parts=None):\n"
           "        self.parts = parts or build_parts(cfg)\n"
           "        self.clock = clock(cfg, self.parts) if clock is not None else None\n")
    found = _builds_in_init(ast.parse(old).body[0])
    assert len(found) == 2 and "build_parts(cfg)" in found[0] and "clock(cfg, self.parts)" in found[1]


# ---- a model's optional hooks: declared in fedlase/model_hooks.py, read through its `hook` -------------------
NOT_MODEL_HOOKS = {"forward",    # every module's own
                   "features",   # LeNet5's and SmallCNN's inner helper, called by their own forward
                   "twin"}       # LeNet5's own, called by RecipFL after checking the model is a LeNet5


def model_probes(tree: ast.AST, hooks: set[str]) -> list[str]:
    """hasattr/getattr calls naming a model hook, and `hook(...)` calls naming an undeclared one (a name held in a
    variable is checked when the accessor runs)."""
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2):
            continue
        name = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
        probe = node.func.id in ("hasattr", "getattr") and name in hooks
        if probe or (node.func.id == "hook" and name is not None and name not in hooks):
            out.append(f"line {node.lineno}: {ast.unparse(node)}")
    return out


def test_no_model_hook_is_probed_outside_the_accessor():
    from fedlase.model_hooks import HOOKS
    files = [p for p in PKG.rglob("*.py") if p != PKG / "model_hooks.py"]
    found = {str(p.relative_to(PKG)): model_probes(ast.parse(p.read_text()), HOOKS) for p in files}
    assert not any(found.values()), {f: v for f, v in found.items() if v}
    users = [str(p.relative_to(PKG)) for p in files if re.search(r"\bhook\(\w[\w.]*, \"", p.read_text())]
    assert {"masks.py", "model_facts.py", "layers.py", "methods/heterofl.py", "methods/depthfl.py",
            "methods/fedlase.py", "models/trace.py"} <= set(users)


def test_the_model_probe_check_catches_a_probe_and_a_misspelt_hook():
    from fedlase.model_hooks import HOOKS
    for code in ('hasattr(model, "channel_groups")', 'getattr(self.model, "scaler_default", True)',
                 'hook(model, "chanel_groups")'):
        assert model_probes(ast.parse(code), HOOKS), code
    assert not model_probes(ast.parse('hook(model, "channel_groups"); getattr(cfg, "seed", 0)'), HOOKS)


def test_the_accessor_refuses_an_undeclared_hook():
    from torch import nn

    from fedlase.model_hooks import hook
    from fedlase.models.lenet import LeNet5
    model = LeNet5(1, 10)
    assert hook(model, "channel_groups")() == model.channel_groups() and hook(model, "sliceable") is True
    assert hook(model, "budgeted_names") is None and hook(nn.Linear(2, 2), "scaler_names") is None
    with pytest.raises(ValueError, match="chanel_groups"):
        hook(model, "chanel_groups")


def test_the_hooks_protocol_lists_every_hook_the_built_in_models_define():
    """Every public method or class attribute of a built-in model (fedlase/models, fedlase/llm) is a declared
    hook, unless it is one of the few named above that fedlase never asks a model in general for."""
    from fedlase.model_hooks import HOOKS
    defined = {}
    for path in [*(PKG / "models").glob("*.py"), *(PKG / "llm").glob("*.py")]:
        for cls in ast.walk(ast.parse(path.read_text())):
            if isinstance(cls, ast.ClassDef) and any(ast.unparse(b).endswith("Module") for b in cls.bases):
                for node in cls.body:
                    names = [node.name] if isinstance(node, ast.FunctionDef) else \
                        [t.id for t in getattr(node, "targets", [getattr(node, "target", None)])
                         if isinstance(t, ast.Name)]
                    defined.update({n: f"{path.name}:{cls.name}" for n in names if not n.startswith("_")})
    assert {"channel_groups", "budgeted_names", "level_rank", "scaler_default", "stages"} <= set(defined)
    missing = set(defined) - HOOKS - NOT_MODEL_HOOKS
    assert not missing, {n: defined[n] for n in missing}

"""The package's import graph, read from the source: no import circle, and the engine names no method, no
analysis and no dataset or model module (it reaches them through fedlase.registry)."""
import ast
from pathlib import Path

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


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in PKG.rglob("*.py")}


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


def test_no_private_flower_module():
    """Only Flower's public API: no `flwr.*._private` module anywhere in fedlase/."""
    bad = []
    for p in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names] \
                if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{p.name}: {m}" for m in mods
                    if m.startswith("flwr") and any(part.startswith("_") for part in m.split("."))]
    assert not bad, bad


# ---- the config is a plain record low in the graph (issue 22) -------------------------------------------------

HEAVY = ("fedlase.methods", "fedlase.models", "fedlase.data", "fedlase.analysis", "fedlase.catalog")


def _loaded_by(module: str) -> list[str]:
    """fedlase modules a fresh interpreter holds after importing `module`."""
    import subprocess
    import sys
    code = f"import sys, {module}; print(' '.join(m for m in sys.modules if m.startswith('fedlase')))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_importing_the_config_loads_no_method_model_or_dataset():
    loaded = _loaded_by("fedlase.config")
    assert "fedlase.config" in loaded
    assert not [m for m in loaded if m.startswith(HEAVY)], loaded


def test_importing_the_engine_loads_no_method_model_or_dataset_loader_and_registers_nothing():
    """The engine needs the partition and augmentation code only: no method, model, loader, analysis or catalog."""
    loaded = _loaded_by("fedlase.engine")
    assert "fedlase.engine" in loaded
    allowed = {"fedlase.data", "fedlase.data.partition", "fedlase.data.augment"}
    assert not [m for m in loaded if m.startswith(HEAVY) and m not in allowed], loaded
    import subprocess
    import sys
    code = ("import fedlase.engine\nfrom fedlase.registry import DATASETS, METHODS, MODELS, PARTITIONS, TRACKERS\n"
            "print(sum(len(r.names()) for r in (DATASETS, METHODS, MODELS, PARTITIONS, TRACKERS)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["0"], proc.stdout + proc.stderr


def test_the_config_imports_nothing_above_it():
    """Its imports (and theirs) are the low layer: errors, levels, options, registry, resources."""
    g, seen, todo = graph(), set(), ["fedlase.config"]
    while todo:
        for n in g.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    assert seen <= {"fedlase", "fedlase.errors", "fedlase.levels", "fedlase.options", "fedlase.registry",
                    "fedlase.resources"}, seen
    assert not any(m.startswith(HEAVY) for m in seen)


def test_only_the_edges_register_the_built_ins():
    """catalog (which imports every built-in) is imported by the programs' entry points only."""
    importers = {m for m, names in graph().items() if "fedlase.catalog" in names}
    assert importers <= {"fedlase", "fedlase.cli", "fedlase.api", "fedlase.runner", "fedlase.sweep",
                         "fedlase.flower.server_app", "fedlase.flower.client_app"}, importers

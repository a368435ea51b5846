"""Registers every choice a program can name: the built-in datasets, models, partitions, methods and analyses
(their modules register themselves in fedlase.registry on import), then third-party plugins: any installed
package that declares an entry point in the group `fedlase.plugins` (its target is imported, and registers
what it defines).

`load_builtins()` is called where a program starts: the CLI, `fedlase.make_config`/`fedlase.run`, Flower's
ServerApp and ClientApp, a sweep's child process. Nothing else imports the built-ins, so the config and the
engine stay light (importing them loads no method, model or dataset module)."""
from __future__ import annotations

import importlib
import importlib.util
import logging
from importlib.metadata import entry_points

log = logging.getLogger("fedlase")

BUILTINS = ("fedlase.analysis", "fedlase.data.builtins", "fedlase.methods", "fedlase.models")
# The text track needs `transformers` (extra `text`); without it, its choices are simply absent.
TEXT_BUILTINS = ("fedlase.data.text", "fedlase.models.transformer")

_loaded = False


def load_plugins() -> list[str]:
    """Import every `fedlase.plugins` entry point; returns their names. A broken plugin is reported, not fatal."""
    loaded = []
    for ep in entry_points(group="fedlase.plugins"):
        try:
            ep.load()
            loaded.append(ep.name)
        except Exception as e:   # a third party's bug must not stop fedlase's own choices from working
            log.warning("fedlase plugin %s could not be loaded: %s", ep.name, e)
    return loaded


def has_text() -> bool:
    return importlib.util.find_spec("transformers") is not None


def load_builtins() -> None:
    """Register the built-ins and the installed plugins; once per process (later calls return at once)."""
    global _loaded
    if _loaded:
        return
    for name in BUILTINS + (TEXT_BUILTINS if has_text() else ()):
        importlib.import_module(name)
    load_plugins()
    _loaded = True

"""Loads every registered choice: the built-in datasets, models, partitions, methods and analyses (their
modules register themselves in fedlase.registry on import), then third-party plugins: any installed package
that declares an entry point in the group `fedlase.plugins` (its target is imported, and registers what it
defines). Importing this module once is all a caller needs to see every choice."""
from __future__ import annotations

import importlib.util
import logging
from importlib.metadata import entry_points

from . import analysis, data, methods, models  # noqa: F401  (built-ins register on import)

log = logging.getLogger("fedlase")

# The text track needs `transformers` (extra `text`); without it, its choices are simply absent.
TEXT = importlib.util.find_spec("transformers") is not None
if TEXT:
    from .data import text as _text_data  # noqa: F401
    from .models import transformer as _text_models  # noqa: F401


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


PLUGINS = load_plugins()

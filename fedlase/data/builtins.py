"""Registers the built-in image datasets and the partition schemes (imported by fedlase.catalog.load_builtins,
never by the engine: importing the engine registers nothing)."""
from fedlase.data.partition import SCHEMES, goliath_split, partition
from fedlase.data.sources import IMAGE_DATASETS, load_dataset
from fedlase.registry import register_dataset, register_partition


def _loader(name: str):
    return lambda cfg: load_dataset(name, cfg.data_dir)


for _name, _src in IMAGE_DATASETS.items():
    register_dataset(_name, _loader(_name), _src.num_classes, "image", _src.help, _src.needs_data_dir,
                     shape=_src.shape, reads_data_dir=_src.reads_data_dir)


def _splitter(scheme: str):
    return lambda labels, num_clients, cfg: partition(labels, num_clients, scheme, alpha=cfg.alpha,
                                                      classes_per_client=cfg.classes_per_client, seed=cfg.seed)


for _scheme, _help in SCHEMES.items():
    register_partition(_scheme, _splitter(_scheme), _help)


def _goliath(labels, num_clients, cfg):
    """RecipFL's setting: the clients of the system's largest level (by index, as the fixed assignment places
    them) are the Goliaths."""
    goliaths = [c for c, lvl in enumerate(cfg.levels.client_level) if lvl == 0]
    return goliath_split(labels, goliaths, num_clients, cfg.alpha, seed=cfg.seed)


register_partition("goliath", _goliath, "RecipFL's: the largest level's clients hold half the data (IID), the others "
                   "split the rest by Dirichlet(alpha)")

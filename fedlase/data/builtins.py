"""Registers the built-in image datasets and the partition schemes (imported by fedlase.catalog.load_builtins,
never by the engine: importing the engine registers nothing)."""
from fedlase.data.partition import SCHEMES, partition
from fedlase.data.sources import IMAGE_DATASETS, load_dataset
from fedlase.registry import register_dataset, register_partition


def _loader(name: str):
    return lambda cfg: load_dataset(name, cfg.data_dir)


for _name, _src in IMAGE_DATASETS.items():
    register_dataset(_name, _loader(_name), _src.num_classes, "image", _src.help, _src.needs_data_dir,
                     shape=_src.shape)


def _splitter(scheme: str):
    return lambda labels, num_clients, cfg: partition(labels, num_clients, scheme, alpha=cfg.alpha,
                                                      classes_per_client=cfg.classes_per_client, seed=cfg.seed)


for _scheme, _help in SCHEMES.items():
    register_partition(_scheme, _splitter(_scheme), _help)

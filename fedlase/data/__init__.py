"""Datasets (loaded once, shared by all clients) and their partitions over clients; the built-ins register
themselves in fedlase.registry here."""

from fedlase.data.partition import local_test_split, partition
from fedlase.data.sources import DEFAULT_DATA_DIRS, Dataset, augment_batch, load_dataset
from fedlase.registry import register_dataset, register_partition


def _loader(name: str):
    return lambda cfg: load_dataset(name, cfg.data_dir)


for _name, _classes, _shape, _help, _needs in (
        ("fashion_mnist", 10, (1, 28, 28), "Fashion-MNIST IDX files (default: the Debian package's folder)", False),
        ("cifar10", 10, (3, 32, 32), "CIFAR-10 python-pickle folder (data_dir)", True),
        ("cifar100", 100, (3, 32, 32), "CIFAR-100 python-pickle folder (data_dir)", True),
        ("digits", 10, (1, 8, 8), "scikit-learn's 8x8 digits (tiny, bundled; for tests)", False)):
    register_dataset(_name, _loader(_name), _classes, "image", _help, _needs, shape=_shape)


def _splitter(scheme: str):
    return lambda labels, num_clients, cfg: partition(labels, num_clients, scheme, alpha=cfg.alpha,
                                                      classes_per_client=cfg.classes_per_client, seed=cfg.seed)


for _scheme, _help in (("iid", "a random permutation cut into near-equal parts"),
                       ("dirichlet", "per-class Dirichlet(alpha) label skew"),
                       ("balanced_dirichlet", "FIARSE's: each client draws p ~ Dir(alpha) and N/n samples"),
                       ("pathological", "classes_per_client classes per client")):
    register_partition(_scheme, _splitter(_scheme), _help)

__all__ = ["DEFAULT_DATA_DIRS", "Dataset", "augment_batch", "load_dataset", "local_test_split", "partition"]

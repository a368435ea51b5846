"""Datasets (loaded once, shared by all clients) and their partitions over clients."""

from fedlase.data.partition import PARTITIONS, local_test_split, partition
from fedlase.data.sources import DATASETS, DEFAULT_DATA_DIRS, Dataset, augment_batch, load_dataset

__all__ = [
    "DATASETS", "DEFAULT_DATA_DIRS", "Dataset", "augment_batch", "load_dataset",
    "PARTITIONS", "local_test_split", "partition",
]

"""Tests for fedlase.data: loaders (IDX, CIFAR pickles, digits), partitioners, local test splits, augmentation."""

import gzip
import pickle
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import idx_bytes, write_fmnist
from fedlase.data import DEFAULT_DATA_DIRS, Dataset, augment_batch, load_dataset, local_test_split, partition
from fedlase.errors import ConfigError, DataError
from fedlase.registry import DATASETS, PARTITIONS

FMNIST_DIR = Path(DEFAULT_DATA_DIRS["fashion_mnist"])
IMAGE_DATASETS = {"fashion_mnist": 10, "cifar10": 10, "cifar100": 100, "digits": 10}
SCHEMES = [s for s in PARTITIONS.names() if s != "goliath"]   # goliath reads the system: tests/test_recipfl.py


@pytest.mark.parametrize("gz", [True, False])
def test_idx_round_trip(tmp_path, gz):
    arrs = write_fmnist(tmp_path, gz=gz)
    ds = load_dataset("fashion_mnist", str(tmp_path))
    assert isinstance(ds, Dataset) and ds.name == "fashion_mnist"
    assert ds.x_train.shape == (12, 1, 6, 6) and ds.x_test.shape == (5, 1, 6, 6)
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    assert ds.in_channels == 1 and ds.image_size == 6 and ds.num_classes == 10 and not ds.augment
    np.testing.assert_array_equal(ds.y_train.numpy(), arrs["train-labels-idx1-ubyte"])
    np.testing.assert_array_equal(ds.y_test.numpy(), arrs["t10k-labels-idx1-ubyte"])
    # Normalisation uses the train set's statistics, and is applied identically to the test set.
    raw_tr = arrs["train-images-idx3-ubyte"].astype(np.float64)
    mean, std = raw_tr.mean(), raw_tr.std()
    np.testing.assert_allclose(ds.x_train[:, 0].numpy(), (raw_tr - mean) / std, atol=1e-5)
    np.testing.assert_allclose(ds.x_test[:, 0].numpy(), (arrs["t10k-images-idx3-ubyte"] - mean) / std, atol=1e-5)


def test_idx_errors(tmp_path):
    stem = "train-images-idx3-ubyte.gz"
    # Wrong magic number.
    write_fmnist(tmp_path)
    (tmp_path / stem).write_bytes(gzip.compress(idx_bytes(np.zeros((12, 6, 6)), 2049)))
    with pytest.raises(DataError, match=stem + ".*magic"):
        load_dataset("fashion_mnist", str(tmp_path))
    # Payload shorter than the header's dimensions claim.
    raw = idx_bytes(np.zeros((12, 6, 6)), 2051)
    (tmp_path / stem).write_bytes(gzip.compress(raw[:-7]))
    with pytest.raises(DataError, match=stem):
        load_dataset("fashion_mnist", str(tmp_path))
    # Truncated gzip stream.
    packed = gzip.compress(raw)
    (tmp_path / stem).write_bytes(packed[: len(packed) // 2])
    with pytest.raises(DataError, match=stem):
        load_dataset("fashion_mnist", str(tmp_path))
    # Not gzip at all.
    (tmp_path / stem).write_bytes(b"this is not gzip data at all")
    with pytest.raises(DataError, match=stem):
        load_dataset("fashion_mnist", str(tmp_path))
    # Image and label counts disagree.
    (tmp_path / stem).write_bytes(gzip.compress(idx_bytes(np.zeros((11, 6, 6)), 2051)))
    with pytest.raises(DataError, match="labels"):
        load_dataset("fashion_mnist", str(tmp_path))
    # A missing file is named.
    (tmp_path / stem).unlink()
    with pytest.raises(DataError, match="train-images-idx3-ubyte"):
        load_dataset("fashion_mnist", str(tmp_path))


def test_missing_folder(tmp_path, monkeypatch):
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match=str(missing)):
        load_dataset("fashion_mnist", str(missing))
    import fedlase.data.sources as sources
    monkeypatch.setitem(sources.DEFAULT_DATA_DIRS, "fashion_mnist", str(missing))
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion_mnist")


def test_unknown_dataset():
    with pytest.raises(ConfigError) as e:
        load_dataset("mnist")
    assert e.value.key == "dataset"
    with pytest.raises(ConfigError) as e:
        DATASETS.get("mnist")
    assert e.value.key == "dataset" and "digits" in str(e.value)
    # the registry holds the image datasets with their class counts (the text ones need the `text` extra)
    assert {n: d.num_classes for n, d in DATASETS.items() if d.kind == "image"} == IMAGE_DATASETS
    assert [n for n, d in DATASETS.items() if d.needs_data_dir and d.kind == "image"] == ["cifar10", "cifar100"]


def test_registered_loader_is_load_dataset(tmp_path):
    # the registry's loader reads the config's data_dir, and knows the class count before loading
    write_fmnist(tmp_path)
    cfg = SimpleNamespace(data_dir=str(tmp_path))
    for name, where in (("fashion_mnist", cfg), ("digits", SimpleNamespace(data_dir=None))):
        a, b = DATASETS.get(name).load(where), load_dataset(name, where.data_dir)
        assert a.name == name and a.num_classes == DATASETS.get(name).num_classes
        assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)


@pytest.mark.skipif(not FMNIST_DIR.is_dir(), reason="Fashion-MNIST not installed")
def test_real_fashion_mnist():
    ds = load_dataset("fashion_mnist")
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.x_test.shape == (10000, 1, 28, 28)
    assert ds.num_classes == 10
    assert np.bincount(ds.y_train.numpy()).tolist() == [6000] * 10
    assert np.bincount(ds.y_test.numpy()).tolist() == [1000] * 10
    assert abs(ds.x_train.mean().item()) < 1e-3 and abs(ds.x_train.std().item() - 1) < 1e-3
    # Every scheme partitions the real labels for 100 clients.
    y = ds.y_train.numpy()
    for scheme in SCHEMES:
        parts = partition(y, 100, scheme, alpha=0.3, seed=1)
        assert sum(len(p) for p in parts) <= 60000 and len(parts) == 100


# --------------------------------------------------------------------------- CIFAR


def _cifar_batch(n, label_key, num_classes, rng):
    return {
        b"batch_label": b"testing batch",
        label_key: [int(v) for v in rng.integers(0, num_classes, n)],
        b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        b"filenames": [b"img_%d.png" % i for i in range(n)],
    }


def _dump(obj, f, protocol):
    if protocol == "old-numpy":
        # Files pickled by numpy 1.x (like the official CIFAR batches) name numpy.core, not numpy._core.
        f.write(pickle.dumps(obj, protocol=2).replace(b"cnumpy._core.", b"cnumpy.core."))
    else:
        pickle.dump(obj, f, protocol=protocol)


def write_cifar10(parent: Path, protocol=2):
    rng = np.random.default_rng(0)
    folder = parent / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batches[name] = _cifar_batch(3, b"labels", 10, rng)
        with open(folder / name, "wb") as f:
            _dump(batches[name], f, protocol)
    return folder, batches


def write_cifar100(parent: Path):
    rng = np.random.default_rng(1)
    folder = parent / "cifar-100-python"
    folder.mkdir(parents=True)
    batches = {}
    for name, n in (("train", 7), ("test", 4)):
        b = _cifar_batch(n, b"fine_labels", 100, rng)
        b[b"coarse_labels"] = [v // 5 for v in b[b"fine_labels"]]
        batches[name] = b
        with open(folder / name, "wb") as f:
            pickle.dump(b, f, protocol=2)
    return folder, batches


@pytest.mark.filterwarnings("error::DeprecationWarning")
@pytest.mark.parametrize("protocol", [2, "old-numpy", pickle.HIGHEST_PROTOCOL])
def test_cifar10(tmp_path, protocol):
    folder, batches = write_cifar10(tmp_path, protocol)
    for where in (folder, tmp_path):  # the batch folder itself or its parent
        ds = load_dataset("cifar10", str(where))
        assert ds.x_train.shape == (15, 3, 32, 32) and ds.x_test.shape == (3, 3, 32, 32)
        assert ds.num_classes == 10 and ds.augment and ds.in_channels == 3 and ds.image_size == 32
        want = sum((batches[f"data_batch_{i}"][b"labels"] for i in range(1, 6)), [])
        assert ds.y_train.tolist() == want
        assert ds.y_test.tolist() == batches["test_batch"][b"labels"]
        # Row layout is channel-major (R plane, G plane, B plane), and channels are normalised separately.
        raw = np.concatenate([batches[f"data_batch_{i}"][b"data"] for i in range(1, 6)])
        raw = raw.reshape(-1, 3, 32, 32).astype(np.float64)
        m, s = raw.mean(axis=(0, 2, 3)), raw.std(axis=(0, 2, 3))
        np.testing.assert_allclose(ds.x_train.numpy(), (raw - m[:, None, None]) / s[:, None, None], atol=1e-4)


def test_cifar100(tmp_path):
    folder, batches = write_cifar100(tmp_path)
    for where in (folder, tmp_path):
        ds = load_dataset("cifar100", str(where))
        assert ds.x_train.shape == (7, 3, 32, 32) and ds.x_test.shape == (4, 3, 32, 32)
        assert ds.num_classes == 100 and ds.augment
        assert ds.y_train.tolist() == batches["train"][b"fine_labels"]
        assert ds.y_test.tolist() == batches["test"][b"fine_labels"]


def test_cifar_errors(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_dataset("cifar10")
    assert e.value.key == "data_dir"
    with pytest.raises(DataError, match="does not exist"):
        load_dataset("cifar10", str(tmp_path / "nope"))
    folder, _ = write_cifar10(tmp_path)
    (folder / "data_batch_3").unlink()
    with pytest.raises(DataError, match="data_batch_3"):
        load_dataset("cifar10", str(tmp_path))
    (folder / "data_batch_3").write_bytes(b"garbage")
    with pytest.raises(DataError, match="data_batch_3"):
        load_dataset("cifar10", str(folder))
    # A pickle that would call an arbitrary function is refused, not executed.
    with open(folder / "data_batch_3", "wb") as f:
        pickle.dump({b"data": Path("x")}, f, protocol=2)
    with pytest.raises(DataError, match="data_batch_3"):
        load_dataset("cifar10", str(folder))
    with open(folder / "data_batch_3", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, f, protocol=2)
    with pytest.raises(DataError, match="data_batch_3.*3072"):
        load_dataset("cifar10", str(folder))


# --------------------------------------------------------------------------- digits


def test_digits():
    a, b = load_dataset("digits"), load_dataset("digits")
    assert a.x_train.shape[1:] == (1, 8, 8) and len(a.x_train) + len(a.x_test) == 1797
    assert len(a.x_test) == 360 and a.num_classes == 10 and not a.augment
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    # Stratified: every class is in both splits in about the same share.
    tr, te = np.bincount(a.y_train.numpy()), np.bincount(a.y_test.numpy())
    assert (te > 0).all() and np.abs(tr / tr.sum() - te / te.sum()).max() < 0.01
    assert abs(a.x_train.mean().item()) < 1e-4 and abs(a.x_train.std().item() - 1) < 1e-2


def test_digits_come_from_the_cache_without_scikit_learn_and_equal_a_fresh_split(tmp_path, monkeypatch):
    """The first load writes the split to the cache folder; a later one reads it without splitting again (the
    only place that imports scikit-learn, about 1 CPU-s a process) and gets the very same tensors; a torn or
    foreign cache file is split anew, and a cache folder that cannot be made only costs the time."""
    from fedlase.data import sources
    monkeypatch.setenv("FEDLASE_CACHE", str(tmp_path))
    first = sources._load_digits()
    [cached] = tmp_path.glob("digits-sklearn-*.npz")
    split = sources._split_digits

    def no_split():
        raise AssertionError("the second load split the digits again instead of reading the cache")
    monkeypatch.setattr(sources, "_split_digits", no_split)
    second = sources._load_digits()
    fields = ("x_train", "y_train", "x_test", "y_test")
    assert all(torch.equal(getattr(first, k), getattr(second, k)) for k in fields)
    fresh = split()
    assert np.array_equal(second.y_train.numpy(), fresh["y_tr"]) and np.array_equal(second.y_test.numpy(),
                                                                                    fresh["y_te"])
    monkeypatch.setattr(sources, "_split_digits", split)
    foreign = {"x_tr": np.zeros((3, 1, 8, 8), np.float32), "y_tr": np.zeros(3, np.int64),
               "x_te": np.zeros((1, 1, 8, 8), np.float32), "y_te": np.zeros(1, np.int64)}
    for spoil in ("torn", "foreign"):   # cut short, or well-formed but not the digits split
        if spoil == "torn":
            cached.write_bytes(cached.read_bytes()[:1000])
        else:
            with open(cached, "wb") as f:
                np.savez(f, **foreign)
        again = sources._load_digits()
        assert all(torch.equal(getattr(first, k), getattr(again, k)) for k in fields), spoil
        assert sources._read_digits(cached) is not None, spoil   # written whole again
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("FEDLASE_CACHE", str(tmp_path / "file" / "below"))   # a cache folder that cannot exist
    assert torch.equal(sources._load_digits().x_train, first.x_train)


# --------------------------------------------------------------------------- partitions


@pytest.fixture(scope="module")
def labels():
    # 60k balanced labels over 10 classes in shuffled order, like Fashion-MNIST.
    return np.random.default_rng(123).permutation(np.repeat(np.arange(10), 6000))


def _check_disjoint(parts, n):
    all_idx = np.concatenate(parts)
    assert len(np.unique(all_idx)) == len(all_idx)  # no sample used twice
    assert all_idx.min() >= 0 and all_idx.max() < n
    for p in parts:
        assert p.dtype == np.int64 and (np.diff(p) > 0).all()  # sorted
    return all_idx


def _max_share(parts, y):
    return float(np.mean([np.bincount(y[p]).max() / len(p) for p in parts]))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_partition_basic(labels, scheme):
    parts = partition(labels, 100, scheme, alpha=0.3, classes_per_client=2, seed=0)
    assert len(parts) == 100 and all(len(p) >= 1 for p in parts)
    all_idx = _check_disjoint(parts, len(labels))
    sizes = [len(p) for p in parts]
    if scheme in ("iid", "balanced_dirichlet", "pathological"):
        assert sizes == [600] * 100
    if scheme in ("iid", "dirichlet", "pathological"):
        assert len(all_idx) == len(labels)  # everything is used


@pytest.mark.parametrize("scheme", SCHEMES)
def test_registered_partition_reads_the_config(labels, scheme):
    # the registry's split is partition() with the config's alpha, classes_per_client and seed
    cfg = SimpleNamespace(alpha=0.5, classes_per_client=3, seed=5)
    got = PARTITIONS.get(scheme).split(labels, 20, cfg)
    want = partition(labels, 20, scheme, alpha=0.5, classes_per_client=3, seed=5)
    assert len(got) == 20 and all(np.array_equal(x, y) for x, y in zip(got, want))


def test_partition_schemes_are_registered():
    assert set(SCHEMES) == {"iid", "dirichlet", "balanced_dirichlet", "pathological"}
    with pytest.raises(ConfigError) as e:
        PARTITIONS.get("shards")
    assert e.value.key == "partition"


def test_partition_sizes_uneven():
    y = np.arange(103) % 10
    sizes = [len(p) for p in partition(y, 10, "iid")]
    assert sorted(sizes) == [10] * 7 + [11] * 3
    parts = partition(y, 10, "balanced_dirichlet", alpha=0.1, seed=3)
    assert [len(p) for p in parts] == [10] * 10
    _check_disjoint(parts, len(y))


def test_balanced_dirichlet_pool_exhaustion():
    # Tiny alpha concentrates every client on one class, so pools run out and demand is re-drawn.
    y = np.repeat(np.arange(5), 20)
    parts = partition(y, 10, "balanced_dirichlet", alpha=0.01, seed=0)
    assert [len(p) for p in parts] == [10] * 10
    assert len(_check_disjoint(parts, len(y))) == 100


def test_label_skew(labels):
    iid = _max_share(partition(labels, 50, "iid", seed=0), labels)
    dirich = _max_share(partition(labels, 50, "dirichlet", alpha=0.1, seed=0), labels)
    bal = _max_share(partition(labels, 50, "balanced_dirichlet", alpha=0.1, seed=0), labels)
    assert iid < 0.2
    assert dirich > iid + 0.3 and bal > iid + 0.3
    # Larger alpha means less skew.
    assert _max_share(partition(labels, 50, "dirichlet", alpha=100.0, seed=0), labels) < 0.2


def test_dirichlet_every_client_nonempty():
    y = np.repeat(np.arange(10), 30)
    for seed in range(3):
        parts = partition(y, 150, "dirichlet", alpha=0.05, seed=seed)
        assert all(len(p) >= 1 for p in parts)
        assert len(_check_disjoint(parts, len(y))) == len(y)


@pytest.mark.parametrize("per_client", [1, 2, 3, 10])
def test_pathological_classes(labels, per_client):
    parts = partition(labels, 30, "pathological", classes_per_client=per_client, seed=4)
    for p in parts:
        assert len(np.unique(labels[p])) == per_client
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= per_client  # near-equal
    assert len(_check_disjoint(parts, len(labels))) == len(labels)


def test_pathological_varied_class_sets(labels):
    sets = {tuple(np.unique(labels[p])) for p in partition(labels, 100, "pathological", seed=0)}
    assert len(sets) > 5  # class pairs are not stuck to a few fixed groups


@pytest.mark.parametrize("scheme", SCHEMES)
def test_partition_determinism(labels, scheme):
    a = partition(labels, 20, scheme, seed=7)
    b = partition(labels, 20, scheme, seed=7)
    c = partition(labels, 20, scheme, seed=8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_partition_bad_arguments(labels):
    cases = [
        (dict(num_clients=10, scheme="iid", alpha=-1), "alpha"),
        (dict(num_clients=10, scheme="dirichlet", alpha=0), "alpha"),
        (dict(num_clients=10, scheme="pathological", classes_per_client=11), "classes_per_client"),
        (dict(num_clients=10, scheme="pathological", classes_per_client=0), "classes_per_client"),
        (dict(num_clients=10, scheme="shards"), "partition"),
        (dict(num_clients=0, scheme="iid"), "num_clients"),
        (dict(num_clients=60001, scheme="iid"), "num_clients"),
    ]
    for kwargs, key in cases:
        with pytest.raises(ConfigError) as e:
            partition(labels, **kwargs)
        assert e.value.key == key
    with pytest.raises(ConfigError, match="C=10"):
        partition(labels, 10, "pathological", classes_per_client=11)
    with pytest.raises(ConfigError, match="one of iid, dirichlet, balanced_dirichlet, pathological"):
        partition(labels, 10, "shards")


# --------------------------------------------------------------------------- local test split


@pytest.fixture(scope="module")
def test_labels():
    return np.repeat(np.arange(10), 1000)


def test_local_test_split_follows_train_distribution(test_labels):
    train = [np.array([0] * 300 + [3] * 100), np.arange(10).repeat(50), np.array([7] * 9)]
    splits = local_test_split(train, test_labels, 10, ratio=0.5, seed=0)
    assert [len(s) for s in splits] == [200, 250, 4]  # round(0.5 * 9) == 4 (round half to even)
    counts0 = np.bincount(test_labels[splits[0]], minlength=10)
    assert counts0[0] == 150 and counts0[3] == 50 and counts0.sum() == 200  # only {0, 3}, 3:1
    assert (np.bincount(test_labels[splits[1]], minlength=10) == 25).all()
    assert set(test_labels[splits[2]]) == {7}
    for s in splits:
        assert s.dtype == np.int64 and len(np.unique(s)) == len(s)  # no repeats when the pool suffices


def test_local_test_split_rounding_and_minimum(test_labels):
    # Largest remainder: 7 samples over counts 5:3:2 -> quotas 3.5, 2.1, 1.4 -> 4, 2, 1.
    train = [np.array([1] * 5 + [2] * 3 + [4] * 2), np.array([5])]
    splits = local_test_split(train, test_labels, 10, ratio=0.7, seed=1)
    assert np.bincount(test_labels[splits[0]], minlength=10)[[1, 2, 4]].tolist() == [4, 2, 1]
    assert len(splits[1]) == 1 and test_labels[splits[1][0]] == 5  # at least one sample


def test_local_test_split_small_class_pool():
    # Class 1 has only 2 test samples but 6 are needed: all are taken, the rest drawn with replacement.
    test_labels = np.array([0] * 50 + [1] * 2)
    splits = local_test_split([np.array([0] * 6 + [1] * 6)], test_labels, 2, ratio=1.0, seed=0)
    lab = test_labels[splits[0]]
    assert (lab == 1).sum() == 6 and (lab == 0).sum() == 6
    assert {50, 51} <= set(splits[0].tolist())


def test_local_test_split_determinism(labels, test_labels):
    parts = partition(labels, 10, "dirichlet", alpha=0.5, seed=0)
    train = [labels[p] for p in parts]
    a = local_test_split(train, test_labels, 10, ratio=1 / 6, seed=3)
    b = local_test_split(train, test_labels, 10, ratio=1 / 6, seed=3)
    c = local_test_split(train, test_labels, 10, ratio=1 / 6, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    assert [len(s) for s in a] == [max(1, round(len(t) / 6)) for t in train]
    with pytest.raises(ConfigError) as e:
        local_test_split(train, test_labels, 10, ratio=0, seed=0)
    assert e.value.key == "local_test_ratio"


# --------------------------------------------------------------------------- augmentation


def test_augment_batch_shape_and_determinism():
    x = torch.randn(64, 3, 32, 32)
    a = augment_batch(x, torch.Generator().manual_seed(5))
    b = augment_batch(x, torch.Generator().manual_seed(5))
    c = augment_batch(x, torch.Generator().manual_seed(6))
    assert a.shape == x.shape and a.dtype == x.dtype
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(a, x)


def _manual(x, oy, ox, flip):
    p = torch.nn.functional.pad(x, (4, 4, 4, 4))
    crop = p[:, :, oy:oy + x.shape[2], ox:ox + x.shape[3]]
    return crop.flip(-1) if flip else crop


def test_augment_batch_is_crop_and_flip():
    # 300 copies of one asymmetric image: every output must be one padded crop, flipped or not.
    img = torch.arange(25, dtype=torch.float32).reshape(1, 1, 5, 5) + 1  # nonzero, all distinct
    out = augment_batch(img.expand(300, 1, 5, 5).contiguous(), torch.Generator().manual_seed(0))
    candidates = {(oy, ox, f): _manual(img, oy, ox, f)[0] for oy in range(9) for ox in range(9)
                  for f in (False, True)}
    kinds = set()
    for o in out:
        matches = [key for key, c in candidates.items() if torch.equal(o, c)]
        assert matches, "output is not a padded crop (optionally flipped) of the input"
        kinds.add(all(f for _, _, f in matches))
        if (4, 4, True) in matches:  # the centre crop of a flip mirrors the columns
            assert torch.equal(o[0, :, 0], img[0, 0, :, -1])
    assert kinds == {True, False}  # both flipped and unflipped outputs occur


def test_augment_batch_flip_rate():
    # The centre crop of a left-to-right ramp either keeps or reverses the ramp; both occur.
    x = torch.arange(32, dtype=torch.float32).expand(512, 1, 32, 32).contiguous()
    out = augment_batch(x, torch.Generator().manual_seed(0))
    d = out[:, 0, 16, 12] - out[:, 0, 16, 11]  # two interior columns, never padding
    frac_flipped = (d < 0).float().mean().item()
    assert 0.4 < frac_flipped < 0.6

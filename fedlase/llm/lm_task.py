"""`task=lm`: next-token prediction on a text dataset's documents, and `dataset=text_folder` (a user's texts).

The documents of each category (the dataset's label) are tokenized whole, each followed by the end-of-text
token, joined in index order within the category and cut into `max_length`-token blocks; a category's last,
shorter piece is dropped. So every block belongs to one category, and its category is the block's label: the
existing partitions (balanced_dirichlet, pathological, ...) deal blocks to clients by category as they deal images
by class, and clients differ by domain. Train and test blocks come from the dataset's own document split, so
no test document is ever trained on.

A client's loss is the mean cross-entropy of every position's prediction of the next token of its block
(`lm_loss`, what fedlase/train.py asks the task for); evaluation sums the same over a level's test blocks and
reports the perplexity, exp(summed loss / predicted tokens) (`lm_score`, fedlase/evaluate.py). The blocks are
cached on disk like the text track's tokens (fedlase/data/text.py), keyed by the documents, the tokenizer and
`max_length`.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..data.sources import Dataset
from ..errors import ConfigError, DataError
from ..models.transformer import max_length_of

_CACHE_VERSION = "1"
FOLDER_TEST_FRACTION = 0.2
FOLDER_SPLIT_SEED = 20240501   # fixed, as BBC News's: every run of a folder shares one split


# ---------------------------------------------------------------------- blocks

def cut_blocks(docs: list[list[int]], labels: np.ndarray, idx: np.ndarray, eos: int,
               length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks (N, length) int64, their categories (N,)): per category in ascending order, the token ids of its
    documents among `idx` (in index order), each followed by `eos`, joined and cut into whole blocks."""
    xs, ys = [], []
    for c in np.unique(labels[idx]):
        stream = [t for i in idx[labels[idx] == c] for t in (*docs[i], eos)]
        n = len(stream) // length
        if n:
            xs.append(torch.tensor(stream[:n * length], dtype=torch.int64).view(n, length))
            ys.append(torch.full((n,), int(c), dtype=torch.int64))
    if not xs:
        return torch.empty(0, length, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
    return torch.cat(xs), torch.cat(ys)


def load_lm(cfg, entry) -> Dataset:
    """The dataset's documents (its registry entry's `texts`) as next-token blocks of the config's model's
    tokenizer; cached on disk."""
    from ..data.text import token_cache
    n = max_length_of(cfg)
    if entry.texts is None:
        raise ConfigError("dataset", f"{cfg.dataset} has no documents for task=lm")
    texts, labels, train, test, data_key = entry.texts(cfg)
    labels = np.asarray(labels)

    def build(load_tok, n):
        tok = load_tok()
        if tok.eos_token_id is None:
            raise ConfigError("model", f"{cfg.model}'s tokenizer has no end-of-text token to join documents with")
        docs = [tok(texts[i:i + 256], add_special_tokens=False)["input_ids"] for i in range(0, len(texts), 256)]
        docs = [d for chunk in docs for d in chunk]
        (x_tr, y_tr), (x_te, y_te) = (cut_blocks(docs, labels, np.asarray(s), int(tok.eos_token_id), n)
                                      for s in (train, test))
        return {"x_train": x_tr, "y_train": y_tr, "x_test": x_te, "y_test": y_te}
    got = token_cache(f"{cfg.dataset}-lm", data_key, cfg, ("x_train", "y_train", "x_test", "y_test"), build)
    if not len(got["x_train"]) or not len(got["x_test"]):
        raise DataError(f"{cfg.dataset}: too little text for one {n}-token block in its "
                        f"{'train' if not len(got['x_train']) else 'test'} split; lower max_length")
    return Dataset(f"{cfg.dataset}-lm", got["x_train"], got["y_train"], got["x_test"], got["y_test"],
                   int(labels.max()) + 1)


# ---------------------------------------------------------------------- loss and score

def next_tokens(logits: torch.Tensor, xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each position's logits, in float, one row a position, the token that follows it) of a batch of blocks:
    the pairs next-token prediction is scored on (the last position predicts nothing)."""
    return logits[:, :-1].float().reshape(-1, logits.shape[-1]), xb[:, 1:].reshape(-1)


def lm_loss(logits: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each position's logits against the block's next token. `yb` (the blocks'
    categories) plays no part."""
    return F.cross_entropy(*next_tokens(logits, xb))


def lm_score(logits: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor) -> tuple[float, int, int]:
    """(summed next-token cross-entropy, predicted tokens, correct top-1 predictions) of a batch of blocks."""
    pred, target = next_tokens(logits, xb)
    nll = F.cross_entropy(pred, target, reduction="sum")
    return float(nll), target.numel(), int((pred.argmax(-1) == target).sum())


def check_lm(cfg) -> None:
    """What task=lm cannot run, in one line each."""
    from ..registry import METHODS
    # a method whose submodels carry a LocalObjective of its own loss declares it by leaving out the batched path
    # (base.py); HetLoRA's penalty objective keeps it: it leaves the loss to the task
    if "batched" not in METHODS.get(cfg.method).runs_on:
        raise ConfigError("method", f"{cfg.method} trains with a local objective of its own (a classification "
                          "loss), which task=lm cannot take; use a method without one (fedavg, fiarse, fedlase, "
                          "heterofl, ...)")
    if cfg.label_split:
        raise ConfigError("label_split", "masks class logits; task=lm has none")
    if cfg.head_norm != "none":
        raise ConfigError("head_norm", "normalises a classification head's features; task=lm has no head")


# ---------------------------------------------------------------------- dataset=text_folder

def folder_documents(cfg) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray, str]:
    """data_dir/<category>/*.txt: (texts, labels, train indices, test indices, a hash of the files). Categories
    are the subfolders in name order; within each, files in name order, a permutation from a fixed seed puts
    round(0.2 n) in test (at least one where the category has two files or more)."""
    d = getattr(cfg, "data_dir", None)
    if not d:
        raise ConfigError("data_dir", "dataset=text_folder needs data_dir: a folder with one subfolder of .txt "
                          "files per category")
    root = Path(d).expanduser()
    if not root.is_dir():
        raise ConfigError("data_dir", f"{root}: no such folder")
    cats = sorted(p for p in root.iterdir() if p.is_dir() and any(p.glob("*.txt")))
    if not cats:
        raise DataError(f"{root}: no category subfolder with .txt files")
    from ..data.text import article, read_hashed, stratified_split
    files = [(c, f) for c, folder in enumerate(cats) for f in sorted(folder.glob("*.txt"))]
    raw, h = read_hashed([f for _, f in files])
    labels = np.asarray([c for c, _ in files], dtype=np.int64)
    train, test = stratified_split(labels, len(cats), FOLDER_TEST_FRACTION, FOLDER_SPLIT_SEED, at_least_one=True)
    return [article(b) for b in raw], labels, train, test, "folder|" + h


def load_text_folder(cfg) -> Dataset:
    """task=classify on a text folder: each document's first max_length tokens, its category as label."""
    from ..data.text import cached_tokens
    max_length_of(cfg)
    texts, labels, train, test, key = folder_documents(cfg)
    ids, y = cached_tokens("text_folder", key, lambda: (texts, labels), cfg)
    return Dataset("text_folder", ids[train], y[train], ids[test], y[test], int(labels.max()) + 1)


from ..registry import register_dataset, register_task  # noqa: E402
from ..util import installed  # noqa: E402

register_task("lm", load_lm, lm_loss, lm_score, check=check_lm,
              help="next-token prediction on a text dataset's documents, cut into max_length-token blocks; "
                   "perplexity per level and client")
if installed("transformers"):
    register_dataset("text_folder", load_text_folder, num_classes=0, kind="text", needs_data_dir=True,
                     texts=folder_documents,
                     help="a folder of .txt documents, one subfolder per category (data_dir)")

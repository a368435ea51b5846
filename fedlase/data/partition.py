"""Split a training set over clients, and draw each client's local test set.

All functions take plain numpy label arrays and return int64 index arrays, so clients
never copy the data. Everything is driven by a numpy Generator built from `seed`.
"""

from __future__ import annotations

import math

import numpy as np

from fedlase.errors import ConfigError, DataError

# The schemes this module implements (fedlase/data/builtins.py registers each; the registry is the one list).
SCHEMES = {"iid": "a random permutation cut into near-equal parts",
           "dirichlet": "per-class Dirichlet(alpha) label skew",
           "balanced_dirichlet": "FIARSE's: each client draws p ~ Dir(alpha) and N/n samples, filled interleaved",
           "pathological": "classes_per_client classes per client"}


def partition(labels: np.ndarray, num_clients: int, scheme: str, *, alpha: float = 0.3,
              classes_per_client: int = 2, seed: int = 0) -> list[np.ndarray]:
    """Split the sample indices of `labels` over `num_clients` clients.

    Returns one sorted int64 index array per client; no index appears twice.

    Schemes:
      iid: a random permutation cut into near-equal parts (sizes differ by at most 1).
      dirichlet: for each class, proportions over clients ~ Dir(alpha); the class's samples
        are cut by those proportions. A client left empty is repaired afterwards by moving
        one random sample to it from the currently largest client, so every client has >= 1.
      balanced_dirichlet (as in FIARSE): each client draws p ~ Dir(alpha) over the classes
        and receives exactly floor(N / num_clients) samples, taken without replacement from
        shared class pools. The clients are filled interleaved, one sample at a time: the
        fill order is a random shuffle of every client's slots, and each sample's class is
        drawn from the client's p restricted to the classes whose pool is not yet empty (from
        the pools' sizes if p puts no mass on any of them). A pool that runs dry thus costs
        every client alike, late in the fill, instead of the last clients by index: an
        earlier version filled client 0 completely, then client 1, ..., so clients 75-99 of
        100 (Fashion-MNIST, alpha 0.3) got the leftover classes, 0.28-0.47 away in total
        variation from their own p against 0.03-0.09 for the others. FIARSE's official
        partitioner also fills one sample at a time, picking a random client that is not
        yet full at each step. The N mod num_clients leftover samples are unused.
        `balanced_dirichlet` returns the draws p alongside the parts.
      pathological: each client holds exactly `classes_per_client` distinct classes. The
        client-class slots are spread evenly over classes; each class is shuffled and cut
        into as many near-equal shards as it has slots, one shard per client.

    Only balanced_dirichlet filled clients in sequence; iid, dirichlet (each class is cut over
    all clients at once) and pathological (each class is cut into equal shards) leave no
    client with leftovers.
    """
    return _partition(labels, num_clients, scheme, alpha, classes_per_client, seed)[0]


def balanced_dirichlet(labels: np.ndarray, num_clients: int, alpha: float = 0.3,
                       seed: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    """`partition(labels, num_clients, "balanced_dirichlet", alpha=alpha, seed=seed)` and the
    clients' Dirichlet draws p, shape (num_clients, C), columns in sorted class order."""
    return _partition(labels, num_clients, "balanced_dirichlet", alpha, 2, seed)


def _partition(labels, num_clients, scheme, alpha, classes_per_client, seed):
    """(parts, the balanced_dirichlet draws or None)."""
    y = _check_labels(labels)
    n = len(y)
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) \
            or not 1 <= num_clients <= n:
        raise ConfigError("num_clients", f"must be an integer between 1 and the {n} samples, got {num_clients!r}")
    if scheme not in SCHEMES:
        raise ConfigError("partition", f"unknown scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    if not (isinstance(alpha, (int, float, np.floating, np.integer)) and math.isfinite(alpha) and alpha > 0):
        raise ConfigError("alpha", f"must be > 0, got {alpha!r}")
    classes = np.unique(y)
    if scheme == "pathological":
        c = len(classes)
        if isinstance(classes_per_client, bool) or not isinstance(classes_per_client, (int, np.integer)) \
                or not 1 <= classes_per_client <= c:
            raise ConfigError("classes_per_client",
                              f"must be an integer between 1 and the number of classes, at most C={c}, "
                              f"got {classes_per_client!r}")
    rng = np.random.default_rng(seed)
    k = int(num_clients)
    draws = None
    if scheme == "iid":
        return [np.sort(p).astype(np.int64) for p in np.array_split(rng.permutation(n), k)], None
    if scheme == "dirichlet":
        owner = _dirichlet_owner(y, classes, k, float(alpha), rng)
    elif scheme == "balanced_dirichlet":
        owner, draws = _balanced_dirichlet_owner(y, classes, k, float(alpha), rng)
    else:
        owner = _pathological_owner(y, classes, k, int(classes_per_client), rng)
    return _group(owner, k), draws


def _check_labels(labels) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1 or not (np.issubdtype(y.dtype, np.integer) or y.size == 0):
        raise DataError(f"labels must be a 1-D integer array, got {y.dtype} with shape {y.shape}")
    if y.size and y.min() < 0:
        raise DataError("labels must be >= 0")
    return y.astype(np.int64, copy=False)


def _group(owner: np.ndarray, k: int) -> list[np.ndarray]:
    """Turn a per-sample owner array (-1 = unused) into sorted index arrays per client."""
    # A stable sort by owner keeps indices ascending within each client, with no Python loop.
    order = np.argsort(owner, kind="stable")
    counts = np.bincount(owner[owner >= 0], minlength=k)
    start = int((owner < 0).sum())
    bounds = start + np.cumsum(counts)[:-1]
    return [part.astype(np.int64) for part in np.split(order[start:], bounds - start)]


def _class_pools(y: np.ndarray, classes: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Indices of each class (in `classes` order), each shuffled."""
    order = np.argsort(y, kind="stable")
    cuts = np.searchsorted(y[order], classes[1:])
    return [rng.permutation(p) for p in np.split(order, cuts)]


def _dirichlet_owner(y, classes, k, alpha, rng) -> np.ndarray:
    owner = np.empty(len(y), dtype=np.int64)
    for pool in _class_pools(y, classes, rng):
        p = rng.dirichlet(np.full(k, alpha))
        # Cut points from cumulative proportions; the last client's share absorbs rounding.
        cuts = np.floor(np.cumsum(p)[:-1] * len(pool)).astype(np.int64)
        counts = np.diff(np.concatenate(([0], np.clip(cuts, 0, len(pool)), [len(pool)])))
        owner[pool] = np.repeat(np.arange(k), counts)
    # Repair: give each empty client one sample from the largest client (k <= N makes this possible).
    sizes = np.bincount(owner, minlength=k)
    for c in np.flatnonzero(sizes == 0):
        donor = int(np.argmax(sizes))
        idx = np.flatnonzero(owner == donor)
        owner[idx[rng.integers(len(idx))]] = c
        sizes[donor] -= 1
        sizes[c] += 1
    return owner


def _balanced_dirichlet_owner(y, classes, k, alpha, rng) -> tuple[np.ndarray, np.ndarray]:
    pools = _class_pools(y, classes, rng)
    c = len(pools)
    left = np.array([len(p) for p in pools], dtype=np.int64)
    used = np.zeros(c, dtype=np.int64)
    owner = np.full(len(y), -1, dtype=np.int64)
    draws = rng.dirichlet(np.full(c, alpha), size=k)
    # Interleaved fill: a shuffled sequence of every client's floor(N / k) slots.
    schedule = rng.permutation(np.repeat(np.arange(k), len(y) // k)).tolist()
    u = rng.random(len(schedule)).tolist()
    # Each client's cumulative mass over the classes still available; rebuilt when a pool empties
    # (at most C times), so a draw is p restricted to the non-empty pools, renormalised.
    cdf = np.cumsum(draws, axis=1)
    for t, client in enumerate(schedule):
        row = cdf[client]
        total = row[-1]
        if total > 0:
            cls = int(np.searchsorted(row, u[t] * total, side="right"))
        else:   # p has no mass on any class still available: draw by the pools' sizes
            sizes = np.cumsum(left)
            cls = int(np.searchsorted(sizes, u[t] * sizes[-1], side="right"))
        if cls >= c or left[cls] == 0:   # u * total rounded up to total: the last available class
            cls = int(np.flatnonzero((draws[client] > 0) & (left > 0))[-1]) if total > 0 \
                else int(np.flatnonzero(left > 0)[-1])
        owner[pools[cls][used[cls]]] = client
        used[cls] += 1
        left[cls] -= 1
        if left[cls] == 0:
            cdf = np.cumsum(draws * (left > 0), axis=1)
    return owner, draws


def _pathological_owner(y, classes, k, per_client, rng) -> np.ndarray:
    c = len(classes)
    pools = _class_pools(y, classes, rng)
    # Slots per class: k * L spread evenly, the remainder to randomly chosen classes.
    slots = np.full(c, (k * per_client) // c, dtype=np.int64)
    slots[rng.permutation(c)[: (k * per_client) % c]] += 1
    # Greedy: each client (in random order) takes the L classes with the most slots left,
    # ties broken at random. Since no class has more slots left than clients left and the
    # total is exactly clients-left * L, this always yields L distinct classes.
    remaining = slots.copy()
    holders: list[list[int]] = [[] for _ in range(c)]
    for client in rng.permutation(k):
        pick = np.lexsort((rng.random(c), -remaining))[:per_client]
        remaining[pick] -= 1
        for cls in pick:
            holders[cls].append(int(client))
    owner = np.full(len(y), -1, dtype=np.int64)
    for cls, pool in enumerate(pools):
        s = len(holders[cls])
        if s == 0:
            continue
        if len(pool) < s:
            raise ConfigError("classes_per_client",
                              f"class {int(classes[cls])} has {len(pool)} samples, too few for the "
                              f"{s} clients that must hold it; use fewer clients or classes per client")
        counts = np.full(s, len(pool) // s)
        counts[: len(pool) % s] += 1
        owner[pool] = np.repeat(np.array(holders[cls]), counts)
    return owner


def local_test_split(client_train_labels: list[np.ndarray], test_labels: np.ndarray, num_classes: int,
                     ratio: float, seed: int) -> list[np.ndarray]:
    """Draw each client's local test set from the shared test set.

    Client i gets max(1, round(ratio * n_i)) test indices (n_i: its training size) whose
    per-class counts follow its training label histogram, rounded by largest remainder
    (ties to the lower class); classes it never trained on get none. Within a class,
    samples are drawn without replacement; if the class has fewer test samples than
    needed, all of them are taken and the rest drawn with replacement. Clients draw
    independently (client i uses its own stream spawned from `seed`), so they may share
    test samples. A client with no training samples gets an empty array.
    Returns sorted int64 index arrays into `test_labels`.
    """
    if not (isinstance(ratio, (int, float, np.floating, np.integer)) and math.isfinite(ratio) and ratio > 0):
        raise ConfigError("local_test_ratio", f"must be > 0, got {ratio!r}")
    yt = _check_labels(test_labels)
    if yt.size and yt.max() >= num_classes:
        raise DataError(f"test labels go up to {int(yt.max())} but num_classes is {num_classes}")
    order = np.argsort(yt, kind="stable")
    starts = np.searchsorted(yt[order], np.arange(num_classes + 1))
    by_class = [order[starts[c]:starts[c + 1]] for c in range(num_classes)]
    streams = np.random.SeedSequence(seed).spawn(len(client_train_labels))
    out = []
    for labels, ss in zip(client_train_labels, streams):
        h = np.bincount(_check_labels(labels), minlength=num_classes)
        if len(h) > num_classes:
            raise DataError(f"client training labels go up to {len(h) - 1} but num_classes is {num_classes}")
        total = int(h.sum())
        if total == 0:
            out.append(np.empty(0, dtype=np.int64))
            continue
        size = max(1, round(ratio * total))
        quota = h * size / total
        counts = np.floor(quota).astype(np.int64)
        # Largest remainder; a class with h == 0 has remainder 0 and is never picked.
        extra = size - int(counts.sum())
        counts[np.argsort(-(quota - counts), kind="stable")[:extra]] += 1
        rng = np.random.default_rng(ss)
        parts = []
        for c in np.flatnonzero(counts):
            pool, need = by_class[c], int(counts[c])
            if len(pool) == 0:
                raise DataError(f"the test set has no samples of class {c}, which a client trains on")
            if need <= len(pool):
                parts.append(rng.choice(pool, need, replace=False))
            else:
                parts.append(np.concatenate([pool, rng.choice(pool, need - len(pool), replace=True)]))
        out.append(np.sort(np.concatenate(parts)).astype(np.int64))
    return out


def goliath_split(labels: np.ndarray, goliaths: list[int], num_clients: int, alpha: float, share: float = 0.5,
                  seed: int = 0) -> list[np.ndarray]:
    """RecipFL's skewed population: the `goliaths` (client indices) hold `share` of the samples between them, an
    IID draw cut into near-equal parts; every other client (a David) gets a part of the rest, split by per-class
    Dirichlet(alpha) label skew (`dirichlet`). Sorted int64 index arrays, one per client; no index twice."""
    y = _check_labels(labels)
    davids = [c for c in range(num_clients) if c not in set(goliaths)]
    if not goliaths or not davids:
        raise ConfigError("system", f"the goliath partition needs clients at the largest level (Goliaths) and at "
                          f"smaller ones (Davids); got {len(goliaths)} and {len(davids)}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    cut = int(round(share * len(y)))
    if not len(goliaths) <= cut <= len(y) - len(davids):
        raise ConfigError("num_clients", f"{len(y)} samples cannot give {len(goliaths)} Goliaths {share:.0%} of them "
                          f"and every one of {len(davids)} Davids at least one")
    big, rest = order[:cut], order[cut:]
    parts: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * num_clients
    for c, p in zip(goliaths, np.array_split(big, len(goliaths))):
        parts[c] = np.sort(p).astype(np.int64)
    small = partition(y[rest], len(davids), "dirichlet", alpha=alpha, seed=int(rng.integers(1 << 31)))
    for c, p in zip(davids, small):
        parts[c] = np.sort(rest[p]).astype(np.int64)
    return parts

"""Make KGAT-format datasets: from MovieLens raw files (a real KG from item metadata) or synthetic.

    python -m trainer data convert movielens-kg --src ../shared/data/ml-100k --out data/ml-100k-kg
    python -m trainer data synth kgat --out data/kgat-amazon-size --preset amazon-book
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.recipes.kgat.data import DataError, KGATData

# amazon-book's statistics in the KGAT paper (Table 1)
PRESETS = {
    "amazon-book": dict(users=70679, items=24915, entities=113487, relations=39, triples=2557746,
                        interactions=652514 + 193920, test_interactions=193920),   # the released files
    "tiny": dict(users=300, items=200, entities=400, relations=4, triples=2400, interactions=6000),
}


@dataclass
class Stats:
    users: int
    items: int
    entities: int
    relations: int
    triples: int
    interactions: int              # train + test
    test_interactions: int = 0     # exact test count (0: test_fraction of each user's items)


def split_per_user(users: np.ndarray, items: np.ndarray, n_users: int, test_fraction: float,
                   seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Random per-user train/test split; every user with an interaction keeps at least one train item."""
    rng = np.random.default_rng(seed)
    order = np.lexsort((items, users))
    users, items = users[order], items[order]
    bounds = np.searchsorted(users, np.arange(n_users + 1))
    train, test = [], []
    for u in range(n_users):
        its = np.unique(items[bounds[u]:bounds[u + 1]])
        k = int(round(len(its) * test_fraction)) if len(its) >= 2 else 0
        k = min(k, len(its) - 1)
        pick = np.zeros(len(its), bool)
        pick[rng.permutation(len(its))[:k]] = True
        train.append(its[~pick])
        test.append(its[pick])
    return train, test


def split_exact(users: np.ndarray, items: np.ndarray, n_users: int, n_test: int,
                seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Exactly n_test random pairs to test, each user keeping at least one train item."""
    rng = np.random.default_rng(seed)
    left = np.bincount(users, minlength=n_users)
    is_test = np.zeros(len(users), bool)
    taken = 0
    for k in rng.permutation(len(users)):
        if taken == n_test:
            break
        if left[users[k]] > 1:
            left[users[k]] -= 1
            is_test[k] = True
            taken += 1
    def sets(mask):
        order = np.lexsort((items[mask], users[mask]))
        u, i = users[mask][order], items[mask][order]
        bounds = np.searchsorted(u, np.arange(n_users + 1))
        return [i[bounds[x]:bounds[x + 1]] for x in range(n_users)]
    return sets(~is_test), sets(is_test)


def _fill(draw, target: int, rng: np.random.Generator) -> np.ndarray:
    """Unique rows from draw(n) until there are `target`, then exactly `target` of them (random)."""
    rows = np.zeros((0, 0), np.int64)
    for _ in range(8):
        more = draw(int((target - len(rows)) * 1.3) + 16)
        rows = np.unique(np.concatenate([rows.reshape(-1, more.shape[1]), more]), axis=0)
        if len(rows) >= target:
            break
    if len(rows) > target:
        rows = rows[np.sort(rng.choice(len(rows), target, replace=False))]
    return rows


def synthesize(stats: Stats, seed: int = 0, test_fraction: float = 0.2) -> KGATData:
    """Clustered, power-law data: users prefer item clusters, and the KG links items of a cluster to
    shared attribute entities, so the graph carries signal a model can learn. Counts are exact
    (unless the id space is too small to hold that many distinct triples or interactions)."""
    s = stats
    if not (0 < s.items < s.entities and s.relations > 0 and s.users > 0):
        raise ValueError(f"synthetic KGAT stats need 0 < items < entities, relations > 0, users > 0: {s}")
    rng = np.random.default_rng(seed)
    n_clusters = max(4, s.items // 25)
    item_cluster = rng.integers(0, n_clusters, s.items)
    attrs = np.arange(s.items, s.entities)
    attr_cluster = rng.integers(0, n_clusters, len(attrs))
    item_pop = 1.0 / np.arange(1, s.items + 1) ** 0.8
    item_pop = rng.permutation(item_pop / item_pop.sum())
    by_cluster = np.argsort(attr_cluster, kind="stable")
    starts = np.searchsorted(attr_cluster[by_cluster], np.arange(n_clusters + 1))

    def triples(n):  # mostly item -> attribute of its cluster; some attribute -> attribute
        heads = rng.choice(s.items, size=n, p=item_pop)
        c = item_cluster[heads]
        has = starts[c + 1] > starts[c]
        pos = np.minimum(starts[c] + (rng.random(n) * np.maximum(starts[c + 1] - starts[c], 1)).astype(np.int64),
                         len(attrs) - 1)
        tails = np.where(has & (rng.random(n) < 0.85), attrs[by_cluster[pos]], rng.choice(attrs, n))
        heads = np.where(rng.random(n) < 0.1, rng.choice(attrs, n), heads)
        return np.stack([heads, rng.integers(0, s.relations, n), tails], 1)

    kg = _fill(triples, s.triples, rng)
    # users: power-law activity, two favourite clusters (80% of their items), popularity inside them
    activity = rng.pareto(1.2, s.users) + 1.0
    share = activity / activity.sum()
    favs = rng.integers(0, n_clusters, (s.users, 2))
    items_by_cluster = np.lexsort((-item_pop, item_cluster))
    istarts = np.searchsorted(item_cluster[items_by_cluster], np.arange(n_clusters + 1))

    def interactions(n):
        users = np.concatenate([np.arange(s.users), rng.choice(s.users, max(n - s.users, 0), p=share)])
        fav = favs[users, rng.integers(0, 2, len(users))]
        size = istarts[fav + 1] - istarts[fav]
        within = (rng.random(len(users)) ** 2 * np.maximum(size, 1)).astype(np.int64)
        own = items_by_cluster[np.minimum(istarts[fav] + within, s.items - 1)]
        items = np.where((rng.random(len(users)) < 0.8) & (size > 0), own, rng.choice(s.items, len(users), p=item_pop))
        return np.stack([users, items], 1)

    pairs = _fill(interactions, s.interactions, rng)
    if s.test_interactions:
        train, test = split_exact(pairs[:, 0], pairs[:, 1], s.users, s.test_interactions, seed + 1)
    else:
        train, test = split_per_user(pairs[:, 0], pairs[:, 1], s.users, test_fraction, seed + 1)
    return KGATData(train=train, test=test, kg=kg.astype(np.int64), n_items=s.items, n_entities=s.entities,
                    n_relations=s.relations)


# ------------------------------------------------------------------------------------------- MovieLens -> KG

def _movielens_ratings(src: Path) -> tuple[np.ndarray, np.ndarray]:
    if (src / "u.data").exists():
        raw = np.loadtxt(src / "u.data", dtype=np.int64, usecols=(0, 1), ndmin=2)
    elif (src / "ratings.dat").exists():
        text = (src / "ratings.dat").read_text(encoding="latin-1").replace("::", " ")
        raw = np.array(text.split(), dtype=np.int64).reshape(-1, 4)[:, :2]
    else:
        raise DataError(f"{src}: no u.data (ml-100k) or ratings.dat (ml-1m)")
    return raw[:, 0], raw[:, 1]


def _movielens_items(src: Path) -> dict[int, tuple[list[str], str | None]]:
    """raw item id -> (genres, release year)."""
    out = {}
    if (src / "u.item").exists():
        genres = [line.split("|")[0] for line in (src / "u.genre").read_text(encoding="latin-1").splitlines()
                  if line.strip()] if (src / "u.genre").exists() else [f"genre{i}" for i in range(19)]
        for lineno, line in enumerate((src / "u.item").read_text(encoding="latin-1").splitlines(), 1):
            if not line.strip():
                continue
            f = line.split("|")
            if len(f) < 5 + len(genres):
                raise DataError(f"{src / 'u.item'}:{lineno}: expected {5 + len(genres)} '|' fields, got {len(f)}")
            year = re.search(r"(\d{4})$", f[2].strip())
            out[int(f[0])] = ([g for g, flag in zip(genres, f[5:]) if flag.strip() == "1"],
                              year.group(1) if year else None)
    elif (src / "movies.dat").exists():
        for lineno, line in enumerate((src / "movies.dat").read_text(encoding="latin-1").splitlines(), 1):
            if not line.strip():
                continue
            f = line.split("::")
            if len(f) != 3:
                raise DataError(f"{src / 'movies.dat'}:{lineno}: expected 3 '::' fields, got {len(f)}")
            year = re.search(r"\((\d{4})\)\s*$", f[1])
            out[int(f[0])] = (f[2].strip().split("|"), year.group(1) if year else None)
    else:
        raise DataError(f"{src}: no u.item (ml-100k) or movies.dat (ml-1m) for the item metadata")
    return out


def convert_movielens(src: str | Path, test_fraction: float = 0.2, seed: int = 2019) -> tuple[KGATData, dict]:
    """MovieLens raw files -> KGATData (items are the entities 0..I-1; genres and years are entities;
    relations 0 'has_genre', 1 'released_in'), plus the id maps for the *_list.txt files."""
    src = Path(src)
    raw_users, raw_items = _movielens_ratings(src)
    meta = _movielens_items(src)
    user_ids, users = np.unique(raw_users, return_inverse=True)
    item_ids, items = np.unique(raw_items, return_inverse=True)
    entity_names = [f"item:{i}" for i in item_ids]
    index: dict[str, int] = {}
    triples = []
    for item, raw in enumerate(item_ids):
        genres, year = meta.get(int(raw), ([], None))
        for rel, names in ((0, [f"genre:{g}" for g in genres]), (1, [f"year:{year}"] if year else [])):
            for name in names:
                if name not in index:
                    index[name] = len(entity_names)
                    entity_names.append(name)
                triples.append((item, rel, index[name]))
    train, test = split_per_user(users.astype(np.int64), items.astype(np.int64), len(user_ids), test_fraction, seed)
    data = KGATData(train=train, test=test, kg=np.asarray(triples, dtype=np.int64).reshape(-1, 3),
                    n_items=len(item_ids), n_entities=len(entity_names), n_relations=2)
    lists = dict(user=[str(u) for u in user_ids], item=[str(i) for i in item_ids], entity=entity_names,
                 relation=["has_genre", "released_in"])
    return data, lists


def write(data: KGATData, out: str | Path, lists: dict | None = None) -> Path:
    """Write the KGAT files (and *_list.txt: `org_id remap_id`)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, sets in (("train.txt", data.train), ("test.txt", data.test)):
        with open(out / name, "w") as fh:
            for u, items in enumerate(sets):
                if name == "train.txt" or len(items):
                    fh.write(" ".join(map(str, [u, *items.tolist()])) + "\n")
    np.savetxt(out / "kg_final.txt", data.kg, fmt="%d")
    lists = lists or dict(item=[str(i) for i in range(data.n_items)], entity=[str(e) for e in range(data.n_entities)])
    for kind, names in lists.items():
        with open(out / f"{kind}_list.txt", "w") as fh:
            fh.write("org_id remap_id\n")
            fh.writelines(f"{n.replace(' ', '_')} {i}\n" for i, n in enumerate(names))
    return out

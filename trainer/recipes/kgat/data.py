"""KGAT data: the KGAT file format, validation split, the collaborative knowledge graph and its Laplacian.

A dataset folder holds (ids 0-based):
  train.txt, test.txt   `user item item ...` (an item repeated on a line: data.duplicates, dropped by default)
  kg_final.txt          `head relation tail`
  item_list.txt, entity_list.txt (optional; one header line, then one line per id) fix the id ranges.
Items are the entities 0..n_items-1. In the collaborative KG users become nodes n_entities.., and
every relation gets an inverse: 0 user->item, 1 item->user, 2+r KG relation r, 2+R+r its inverse.
"""
from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.data import cache
from trainer.data.flat import Ragged, check_dense, stable_order
from trainer.data.kernels import parse_columns
from trainer.data.text import line_numbers, read_int_rows, text_lines

log = logging.getLogger(__name__)


class DataError(ValueError):
    """Malformed input; the message names the file, line and field."""


@dataclass
class KGATData:
    """Per-user item sets and the KG triples, with their id ranges."""

    train: list[np.ndarray] | Ragged   # per user, sorted unique item ids (read files: flat, a view per user)
    test: list[np.ndarray] | Ragged
    kg: np.ndarray                 # (N, 3) int64 head, relation, tail
    n_items: int
    n_entities: int
    n_relations: int               # KG relations, without inverses
    val: list[np.ndarray] | None = None
    id_maps: dict[str, np.ndarray] | None = None   # data.remap_ids: the original id of each id, per kind

    @property
    def n_users(self) -> int:
        return len(self.train)

    def pairs(self, which: str = "train") -> tuple[np.ndarray, np.ndarray]:
        """(users, items) arrays of one split."""
        sets = getattr(self, which)
        if isinstance(sets, Ragged):
            return np.repeat(np.arange(len(sets)), sets.lengths()).astype(np.int64), sets.flat.astype(np.int64)
        users = np.repeat(np.arange(len(sets)), [len(s) for s in sets])
        items = np.concatenate(sets) if sets else np.zeros(0, np.int64)
        return users.astype(np.int64), items.astype(np.int64)


# ------------------------------------------------------------------------------------------------ parsing

def _bad_field(path: Path, lineno: int, fields: list[str], names) -> DataError:
    for j, tok in enumerate(fields):
        name = names(j)
        try:
            value = int(tok)
        except ValueError:
            return DataError(f"{path}:{lineno}: field '{name}': {tok!r} is not an integer")
        if value < 0:
            return DataError(f"{path}:{lineno}: field '{name}': negative id {value}")
    return DataError(f"{path}:{lineno}: malformed line {' '.join(fields)[:80]!r}")


class UserRows(Mapping):
    """{user: sorted items} held flat: the users in file order, and their items cut at offsets (a view each)."""

    def __init__(self, users: np.ndarray, offsets: np.ndarray, items: np.ndarray):
        self.users, self.offsets, self.items = users, offsets, items

    @functools.cached_property
    def _row(self) -> dict[int, int]:
        """user -> its row: made only where a user is looked up by id (load() reads the arrays)."""
        return {int(u): k for k, u in enumerate(self.users.tolist())}

    def __getitem__(self, user: int) -> np.ndarray:
        k = self._row[user]
        return self.items[self.offsets[k]:self.offsets[k + 1]]

    def __iter__(self):
        return iter(self._row)

    def __len__(self) -> int:
        return len(self.users)

    def dense(self, n_users: int) -> Ragged:
        """Every user 0..n_users-1 (no line: no items) as one Ragged."""
        order = np.argsort(self.users, kind="stable")
        lengths = np.diff(self.offsets)[order]
        shift = np.repeat(self.offsets[:-1][order] - (np.cumsum(lengths) - lengths), lengths)
        counts = np.zeros(n_users, dtype=np.int64)
        counts[self.users] = np.diff(self.offsets)
        return Ragged(self.items[np.arange(int(lengths.sum())) + shift],
                      np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))


def _read_cf_fast(path: Path, duplicates: str) -> UserRows | None:
    """read_cf with array operations (None where the file needs the line parser's messages)."""
    parsed = read_int_rows(path)
    if parsed is None:
        return None
    values, offsets, lines = parsed
    users = values[offsets[:-1]]
    order = np.argsort(users, kind="stable")
    again = np.flatnonzero(users[order][1:] == users[order][:-1])
    if len(again):                                    # a user on two lines: the line parser says which
        return None
    counts = np.diff(offsets) - 1
    row = np.repeat(np.arange(len(users)), counts)
    is_item = np.ones(len(values), dtype=bool)
    is_item[offsets[:-1]] = False
    items = values[is_item]
    by_item = stable_order(row, items)
    row, items = row[by_item], items[by_item]
    repeat = np.concatenate([[False], (row[1:] == row[:-1]) & (items[1:] == items[:-1])])
    if repeat.any():
        _report_repeats(path, int(repeat.sum()), int(lines[row[repeat].min()]), duplicates)
        if duplicates != "keep":
            row, items = row[~repeat], items[~repeat]
    kept = np.bincount(row, minlength=len(users))
    return UserRows(users, np.concatenate([[0], np.cumsum(kept)]).astype(np.int64), items)


def read_cf(path: str | Path, duplicates: str = "drop") -> Mapping[int, np.ndarray]:
    """`user item item ...` lines -> {user: sorted items}. A user may have no items. An item repeated on its
    user's line is dropped with a warning, kept, or refused (`duplicates`). Parsed with array operations; a
    file they refuse is read again line by line, which names the bad line and field."""
    path = Path(path)
    fast = _read_cf_fast(path, duplicates)
    return fast if fast is not None else _read_cf_lines(path, duplicates)


def _read_cf_lines(path: Path, duplicates: str) -> dict[int, np.ndarray]:
    """read_cf line by line: slow, and names the bad line and field."""
    out: dict[int, np.ndarray] = {}
    first_line: dict[int, int] = {}
    repeats, first_repeat = 0, 0
    for lineno, line in text_lines(path, DataError):
        fields = line.split()
        if not fields:
            continue
        try:
            ids = np.array(fields, dtype=np.int64)
        except (ValueError, OverflowError):
            raise _bad_field(path, lineno, fields, lambda j: "user" if j == 0 else f"item {j}") from None
        if (ids < 0).any():
            raise _bad_field(path, lineno, fields, lambda j: "user" if j == 0 else f"item {j}")
        user = int(ids[0])
        if user in out:
            raise DataError(f"{path}:{lineno}: field 'user': user {user} already has a line "
                            f"({path.name}:{first_line[user]})")
        items = np.unique(ids[1:])
        if len(items) < len(ids) - 1:
            repeats, first_repeat = repeats + len(ids) - 1 - len(items), first_repeat or lineno
            if duplicates == "keep":
                items = np.sort(ids[1:])
        out[user], first_line[user] = items, lineno
    if not out:
        raise DataError(f"{path}: empty file (expected lines 'user item item ...')")
    if repeats:
        _report_repeats(path, repeats, first_repeat, duplicates)
    return out


def cf_file(folder: Path, name: str) -> Path:
    """train/test: NAME.txt, else NAME.parquet (one row per interaction)."""
    txt = folder / f"{name}.txt"
    return txt if txt.exists() or not (folder / f"{name}.parquet").exists() else folder / f"{name}.parquet"


def read_cf_any(path: Path, duplicates: str, columns: tuple[str, str] = ("", "")):
    """read_cf of a text file, read_cf_table of a Parquet file."""
    return read_cf_table(path, duplicates, columns) if path.suffix == ".parquet" else read_cf(path, duplicates)


def read_cf_table(path: Path, duplicates: str, columns: tuple[str, str] = ("", "")) -> UserRows:
    """A Parquet file of interactions, one (user, item) per row (data.user_column / data.item_column, default
    `user` and `item`; the `parquet` extra): the same rows as a `user item item ...` file, items sorted per user."""
    from trainer.data.arrow import read_table

    def pick(header: list[str]) -> tuple[int, int, None]:
        lower = [h.lower() for h in header]
        found = []
        for given, default in zip(columns, ("user", "item")):
            if (given or default).lower() not in lower:
                raise DataError(f"{path}: no column {(given or default)!r} (it has {', '.join(header)}); "
                                f"data.{default}_column=NAME names another")
            found.append(lower.index((given or default).lower()))
        return found[0], found[1], None
    users, items, _ = read_table(path, "parquet", pick, DataError)
    if users.dtype.kind not in "iu" or items.dtype.kind not in "iu":
        raise DataError(f"{path}: user and item ids must be integers >= 0 here (they index the model's tables); "
                        f"ids that are names: convert them to SASRec's formats, or number them")
    order = np.lexsort((items, users))
    u, it = users[order], items[order]
    repeat = np.concatenate([[False], (u[1:] == u[:-1]) & (it[1:] == it[:-1])]) if len(u) else np.zeros(0, bool)
    if repeat.any():
        _report_repeats(path, int(repeat.sum()), f"row {int(order[repeat].min())}", duplicates)
        if duplicates != "keep":
            u, it = u[~repeat], it[~repeat]
    starts = np.flatnonzero(np.concatenate([[True], u[1:] != u[:-1]])) if len(u) else np.zeros(0, np.int64)
    return UserRows(u[starts], np.concatenate([starts, [len(u)]]).astype(np.int64), it)


def _report_repeats(path: Path, repeats: int, first: int | str, duplicates: str) -> None:
    """Items repeated on their user's line: refused (duplicates=error), or said once and dropped or kept. `first`:
    the line of the first (a Parquet file's: "row N")."""
    what = f"{path}: {repeats} duplicate interaction(s) (an item repeated on its user's line), first at " \
           f"{first if isinstance(first, str) else f'line {first}'}"
    if duplicates == "error":
        raise DataError(f"{what}.\nHINT: remove them, or set data.duplicates=drop (or keep).")
    log.warning("%s: %s (data.duplicates=%s)", what, "kept" if duplicates == "keep" else "dropped", duplicates)


def read_kg(path: str | Path) -> np.ndarray:
    """`head relation tail` lines -> (N, 3) int64 (a fast path, and a slow one that names the bad line)."""
    path = Path(path)
    names = ("head", "relation", "tail")
    cols = parse_columns(path, "iii")                 # in C++, where the data kernels are built
    if cols is not None and len(cols[0]) and all((c >= 0).all() for c in cols):
        return np.stack(cols, axis=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")          # an empty file is reported below, with its name
            kg = np.loadtxt(path, dtype=np.int64, ndmin=2, comments=None)
        if kg.size and kg.shape[1] == 3 and (kg >= 0).all():
            return kg
    except ValueError:
        pass
    rows = []
    for lineno, line in text_lines(path, DataError):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 3:
            raise DataError(f"{path}:{lineno}: expected 3 fields (head relation tail), got {len(fields)}")
        try:
            row = [int(x) for x in fields]
        except ValueError:
            raise _bad_field(path, lineno, fields, lambda j: names[j]) from None
        if min(row) < 0:
            raise _bad_field(path, lineno, fields, lambda j: names[j])
        rows.append(row)
    if not rows:
        raise DataError(f"{path}: empty file (expected lines 'head relation tail')")
    return np.asarray(rows, dtype=np.int64)


def _count_list(path: Path) -> int | None:
    """Ids in item_list.txt / entity_list.txt (one header line), None if absent."""
    if not path.exists():
        return None
    return max(sum(1 for _, line in text_lines(path, DataError) if line.strip()) - 1, 0)


def _as_rows(sets: Mapping[int, np.ndarray]) -> UserRows:
    """read_cf's result as UserRows (the line parser's dict is made flat)."""
    if isinstance(sets, UserRows):
        return sets
    lengths = [len(v) for v in sets.values()]
    items = np.concatenate(list(sets.values())) if sets else np.zeros(0, np.int64)
    return UserRows(np.fromiter(sets, dtype=np.int64, count=len(sets)),
                    np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), items.astype(np.int64))


def _check_items(rows: UserRows, path: Path, limit: int, what: str) -> None:
    """The first user (in file order) with an item outside 0..limit-1, named with its line."""
    owner = np.repeat(np.arange(len(rows.users)), np.diff(rows.offsets))
    outside = owner[rows.items >= limit]
    if len(outside):
        k = int(outside.min())
        user = int(rows.users[k])
        raise DataError(f"{_where_user(path, user)}: user {user}: item {int(rows[user].max())} is "
                        f"outside the {what} range 0..{limit - 1}")


def _where_user(path: Path, user: int) -> str:
    """file:line of a user's line (a Parquet file: the file and the user, whose rows may be anywhere)."""
    if path.suffix == ".parquet":
        return f"{path} (the rows of user {user})"
    return f"{path}:{_line_of_user(path, user)}"


def _line_of_user(path: Path, user: int) -> int:
    for lineno, line in text_lines(path, DataError):
        if line.split()[:1] == [str(user)]:
            return lineno
    return 0


def load(folder: str | Path, duplicates: str = "drop", remap_ids: bool = False,
         columns: tuple[str, str] = ("", "")) -> KGATData:
    """Read and validate a KGAT-format folder; `remap_ids` compacts sparse ids (compact_ids) where their tables
    would otherwise be refused (_check_tables)."""
    folder = Path(folder)
    for name in ("train", "test", "kg_final"):
        if not (folder / f"{name}.txt").exists() and (name == "kg_final" or not (folder / f"{name}.parquet").exists()):
            raise DataError(f"{folder / name}.txt: missing (a KGAT dataset has train.txt, test.txt, kg_final.txt; "
                            f"train.parquet and test.parquet may stand for the first two)")
    train = _as_rows(read_cf_any(cf_file(folder, "train"), duplicates, columns))
    test = _as_rows(read_cf_any(cf_file(folder, "test"), duplicates, columns))
    kg = read_kg(folder / "kg_final.txt")
    strangers = test.users[~np.isin(test.users, train.users)]
    if len(strangers):
        user = int(strangers[0])
        raise DataError(f"{_where_user(cf_file(folder, 'test'), user)}: field 'user': "
                        f"user {user} has no line in train.txt")
    max_item = int(max(rows.items.max() if len(rows.items) else -1 for rows in (train, test)))
    n_items = _count_list(folder / "item_list.txt") or max_item + 1
    n_entities = _count_list(folder / "entity_list.txt") or max(int(kg[:, [0, 2]].max()) + 1, n_items)
    for rows, name in ((train, "train.txt"), (test, "test.txt")):
        _check_items(rows, cf_file(folder, name[:-4]), n_items, "item")
        _check_items(rows, cf_file(folder, name[:-4]), n_entities, "entity")
    bad = np.nonzero((kg[:, 0] >= n_entities) | (kg[:, 2] >= n_entities))[0]
    if bad.size:
        h, r, t = kg[bad[0]]
        raise DataError(f"{folder / 'kg_final.txt'}: triple ({h} {r} {t}) #{bad[0] + 1}: entity outside "
                        f"0..{n_entities - 1} (entity_list.txt)")
    maps = None
    if remap_ids:                                       # data.remap_ids=true: sparse ids compacted, the maps kept
        train, test, kg, n_items, n_entities, maps = compact_ids(train, test, kg, n_items)
    _check_tables(folder, train, test, kg, n_items, n_entities)
    n_users = int(train.users.max()) + 1
    return KGATData(train=train.dense(n_users), test=test.dense(n_users), kg=kg, n_items=n_items,
                    n_entities=n_entities, n_relations=int(kg[:, 1].max()) + 1, id_maps=maps)


def compact_ids(train: UserRows, test: UserRows, kg: np.ndarray, n_items: int):
    """Every id kind made dense in its original order: users, items (entities below n_items are items, so the
    items used anywhere come first among the entities), the other entities, relations. Returns the new rows,
    triples and counts, and maps {kind: original id of each new id}."""
    ents = kg[:, [0, 2]].reshape(-1)
    item_ids = np.unique(np.concatenate([train.items, test.items, ents[ents < n_items]]))
    other_ids = np.unique(ents[ents >= n_items])
    user_ids = np.unique(train.users)
    relation_ids = np.unique(kg[:, 1])

    def entity(x):
        return np.where(x < n_items, np.searchsorted(item_ids, x), len(item_ids) + np.searchsorted(other_ids, x))

    def rows(r: UserRows) -> UserRows:
        return UserRows(np.searchsorted(user_ids, r.users), r.offsets, np.searchsorted(item_ids, r.items))
    new_kg = np.stack([entity(kg[:, 0]), np.searchsorted(relation_ids, kg[:, 1]), entity(kg[:, 2])], axis=1)
    maps = dict(user=user_ids, item=item_ids, entity=np.concatenate([item_ids, other_ids]), relation=relation_ids)
    return rows(train), rows(test), new_kg.astype(np.int64), len(item_ids), len(maps["entity"]), maps


def _line_of_item(folder: Path, rows: dict[str, UserRows], item: int) -> str:
    """file:line of the first user line (train, then test) holding `item`."""
    for name, r in rows.items():
        at = np.flatnonzero(r.items == item)
        if len(at):
            user = int(r.users[np.searchsorted(r.offsets, at[0], side="right") - 1])
            return _where_user(cf_file(folder, name[:-4]), user)
    return str(folder / "train.txt")


def _check_tables(folder: Path, train: UserRows, test: UserRows, kg: np.ndarray, n_items: int,
                  n_entities: int) -> None:
    """Every id kind that sizes a table of the model (users, items, entities, relations) is dense enough
    (trainer/data/flat.py: check_dense), with or without item_list.txt / entity_list.txt."""
    kg_file = folder / "kg_final.txt"
    top_user = int(train.users.max())
    check_dense("user", len(train.users), top_user + 1, top_user,
                _where_user(cf_file(folder, "train"), top_user), DataError)
    items = np.unique(np.concatenate([train.items, test.items]))
    listed = (folder / "item_list.txt").exists()
    top_item = n_items - 1 if listed else int(items[-1])
    check_dense("item", len(items), n_items, top_item, f"{folder / 'item_list.txt'} (its {n_items:,} ids)" if listed
                else _line_of_item(folder, {"train.txt": train, "test.txt": test}, top_item), DataError)
    entities = np.union1d(np.unique(kg[:, [0, 2]]), items)
    ends = kg[:, [0, 2]].max(axis=1)
    if (folder / "entity_list.txt").exists():
        where = f"{folder / 'entity_list.txt'} (its {n_entities:,} ids)"
    elif len(kg) and int(ends.max()) == n_entities - 1:
        where = f"{kg_file}:{int(line_numbers(kg_file, [int(np.argmax(ends))])[0])}"
    else:                                               # the largest entity is an item of the CF files
        where = _line_of_item(folder, {"train.txt": train, "test.txt": test}, n_entities - 1)
    check_dense("entity", len(entities), n_entities, n_entities - 1, where, DataError)
    if len(kg):
        row = int(np.argmax(kg[:, 1]))
        check_dense("relation", len(np.unique(kg[:, 1])), int(kg[row, 1]) + 1, int(kg[row, 1]),
                    f"{kg_file}:{int(line_numbers(kg_file, [row])[0])}", DataError)


READER = 2                     # the parse's version: part of the cache key
FILES = ("train.txt", "test.txt", "train.parquet", "test.parquet", "kg_final.txt", "item_list.txt", "entity_list.txt")


def build_flat(folder: str, duplicates: str, remap_ids: bool = False,
               columns: tuple[str, str] = ("", "")) -> tuple[dict[str, np.ndarray], dict]:
    """The parsed-data cache's builder (trainer/data/cache.py): load()'s result as flat arrays and meta."""
    data = load(folder, duplicates, remap_ids, tuple(columns))
    arrays = dict(train=data.train.flat, train_offsets=data.train.offsets, test=data.test.flat,
                  test_offsets=data.test.offsets, kg=data.kg)
    arrays.update({f"ids_{kind}": ids for kind, ids in (data.id_maps or {}).items()})
    return arrays, dict(n_items=data.n_items, n_entities=data.n_entities, n_relations=data.n_relations)


def load_cached(folder: str | Path, duplicates: str = "drop", cache_setting: str = "",
                local_rank: int = 0, remap_ids: bool = False, columns: tuple[str, str] = ("", ""),
                cap_gb: float = cache.DEFAULT_CAP_GB) -> KGATData:
    """load(), parsed once into the data cache (data.cache) and memory-mapped after; "off": load() itself."""
    root = cache.root_of(cache_setting)
    folder = Path(folder).resolve()
    if root is None or not cf_file(folder, "train").exists():
        return load(folder, duplicates, remap_ids, columns)    # (its message names what is missing)
    files = [folder / name for name in FILES if (folder / name).exists()]
    settings = dict(duplicates=duplicates, reader=READER, remap_ids=remap_ids, columns=list(columns))
    arrays, meta = cache.load_or_build_files(root, "kgat", folder, files, settings,
                                             "trainer.recipes.kgat.data:build_flat",
                                             (str(folder), duplicates, remap_ids, list(columns)), local_rank,
                                             error=DataError, cap_gb=cap_gb)
    maps = {k[4:]: v for k, v in arrays.items() if k.startswith("ids_")} or None
    return KGATData(train=Ragged(arrays["train"], arrays["train_offsets"]),
                    test=Ragged(arrays["test"], arrays["test_offsets"]), kg=arrays["kg"], n_items=meta["n_items"],
                    n_entities=meta["n_entities"], n_relations=meta["n_relations"], id_maps=maps)


def hold_out_validation(data: KGATData, fraction: float, seed: int) -> KGATData:
    """Move `fraction` of each user's train items (users with >= 2) to a validation split."""
    if fraction <= 0:
        data.val = None
        return data
    rng = np.random.default_rng(seed)
    train, val = [], []
    for items in data.train:
        k = int(round(len(items) * fraction)) if len(items) >= 2 else 0
        k = min(max(k, 1 if len(items) >= 2 else 0), len(items) - 1) if len(items) else 0
        chosen = rng.permutation(len(items))[:k]
        mask = np.zeros(len(items), bool)
        mask[chosen] = True
        train.append(items[~mask])
        val.append(items[mask])
    if not any(len(v) for v in val):
        raise DataError("validation split is empty: no user has 2 or more train items (set data.val_fraction=0)")
    data.train, data.val = train, val
    return data


# ------------------------------------------------------------------------------ collaborative knowledge graph

@dataclass
class CKG:
    """Edges (head, relation, tail) of the collaborative KG, sorted by head, with Laplacian weights."""

    heads: torch.Tensor
    rels: torch.Tensor
    tails: torch.Tensor
    weights: torch.Tensor          # Laplacian-normalised adjacency values, one per edge
    n_nodes: int
    n_relations: int               # including inverses and the two interaction relations


def build_ckg(data: KGATData, laplacian: str = "random-walk") -> CKG:
    """Interactions + KG triples, each with an inverse, and the Laplacian weights of laplacian_weights()."""
    users, items = data.pairs("train")
    R, E = data.n_relations, data.n_entities
    u_nodes = users + E
    h = np.concatenate([u_nodes, items, data.kg[:, 0], data.kg[:, 2]])
    t = np.concatenate([items, u_nodes, data.kg[:, 2], data.kg[:, 0]])
    r = np.concatenate([np.zeros(len(users)), np.ones(len(users)), data.kg[:, 1] + 2, data.kg[:, 1] + 2 + R])
    order = np.lexsort((t, h))
    heads, rels, tails = (torch.from_numpy(np.ascontiguousarray(x[order]).astype(np.int64)) for x in (h, r, t))
    n_nodes = E + data.n_users
    weights = laplacian_weights(heads, rels, tails, n_nodes, 2 + 2 * R, laplacian)
    return CKG(heads, rels, tails, weights, n_nodes, 2 + 2 * R)


def laplacian_weights(heads: torch.Tensor, rels: torch.Tensor, tails: torch.Tensor, n_nodes: int,
                      n_relations: int, kind: str) -> torch.Tensor:
    """Per-edge values of the normalised adjacency of each relation, summed over relations as the original
    code does (its `si` / `bi` Laplacians per relation): D_r^-1 A_r (random walk: every row of every
    relation sums to 1) or D_r^-1/2 A_r D_r^-1/2 (symmetric). Duplicate edges count once each."""
    def degree(nodes: torch.Tensor) -> torch.Tensor:
        return torch.bincount(rels * n_nodes + nodes, minlength=n_relations * n_nodes).clamp(min=1).double()

    deg_h = degree(heads)[rels * n_nodes + heads]
    if kind == "random-walk":
        return (1.0 / deg_h).float()
    if kind == "symmetric":
        deg_t = degree(tails)[rels * n_nodes + tails]
        return (deg_h.rsqrt() * deg_t.rsqrt()).float()
    raise ValueError(f"data.laplacian: unknown kind {kind!r} (random-walk, symmetric)")

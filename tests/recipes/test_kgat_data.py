"""KGAT data: parsers and their errors, MovieLens -> KG converter, synthetic generator, CKG and Laplacian."""
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import PY, REPO, clean_env
from trainer.recipes.kgat import convert
from trainer.recipes.kgat import data as kd

ML100K = REPO.parent / "shared" / "data" / "ml-100k"


def write(folder: Path, **files: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("__", ".")).write_text(text)
    return folder


GOOD = dict(train__txt="0 1 2 2 3\n1 0 4\n2 3\n", test__txt="0 4\n1 2 3\n", kg_final__txt="0 0 5\n1 1 6\n4 0 5\n")


def test_load_good_folder_drops_duplicates(tmp_path):
    d = kd.load(write(tmp_path, **GOOD))
    assert [t.tolist() for t in d.train] == [[1, 2, 3], [0, 4], [3]]
    assert [t.tolist() for t in d.test] == [[4], [2, 3], []]
    assert (d.n_users, d.n_items, d.n_entities, d.n_relations) == (3, 5, 7, 2)
    users, items = d.pairs("train")
    assert users.tolist() == [0, 0, 0, 1, 1, 2] and items.tolist() == [1, 2, 3, 0, 4, 3]


@pytest.mark.parametrize("files,message", [
    (dict(train__txt="0 1 x\n"), "train.txt:1: field 'item 2': 'x' is not an integer"),
    (dict(train__txt="0 1\n1 -3\n"), "train.txt:2: field 'item 1': negative id -3"),
    (dict(train__txt="0 1\n\n0 2\n"), "train.txt:3: field 'user': user 0 already has a line (train.txt:1)"),
    (dict(train__txt="\n"), "train.txt: empty file"),
    (dict(test__txt="0 1\n7 2\n"), "test.txt:2: field 'user': user 7 has no line in train.txt"),
    (dict(kg_final__txt="0 0 5\n1 1\n"), "kg_final.txt:2: expected 3 fields"),
    (dict(kg_final__txt="0 0 5\n1 r 6\n"), "kg_final.txt:2: field 'relation': 'r' is not an integer"),
    (dict(kg_final__txt="0 0 -5\n"), "kg_final.txt:1: field 'tail': negative id -5"),
    (dict(kg_final__txt=""), "kg_final.txt: empty file"),
    (dict(entity_list__txt="org_id remap_id\n" + "".join(f"e{i} {i}\n" for i in range(4))),
     "train.txt:2: user 1: item 4 is outside the entity range 0..3"),
    (dict(item_list__txt="org_id remap_id\n" + "".join(f"i{i} {i}\n" for i in range(5)),
          entity_list__txt="org_id remap_id\n" + "".join(f"e{i} {i}\n" for i in range(6))),
     "kg_final.txt: triple (1 1 6) #2: entity outside 0..5"),
])
def test_errors_name_file_line_and_field(tmp_path, files, message):
    with pytest.raises(kd.DataError, match=None) as err:
        kd.load(write(tmp_path, **{**GOOD, **files}))
    assert message in str(err.value)


def test_missing_file_is_named(tmp_path):
    write(tmp_path, train__txt="0 1\n", test__txt="0 2\n")
    with pytest.raises(kd.DataError, match="kg_final.txt: missing"):
        kd.load(tmp_path)


def test_validation_hold_out_partitions_train():
    d = convert.synthesize(convert.Stats(**convert.PRESETS["tiny"]))
    before = [t.copy() for t in d.train]
    d = kd.hold_out_validation(d, 0.1, seed=3)
    for old, new, val in zip(before, d.train, d.val):
        assert not set(new) & set(val) and sorted([*new, *val]) == sorted(old)
        assert len(new) >= 1 and (len(val) >= 1) == (len(old) >= 2)
    empty = kd.KGATData([np.array([1])], [np.array([2])], np.zeros((1, 3), np.int64), 3, 4, 1)
    with pytest.raises(kd.DataError, match="validation split is empty"):
        kd.hold_out_validation(empty, 0.1, 0)


def test_ckg_has_every_inverse_and_random_walk_rows_sum_to_one_per_relation():
    d = convert.synthesize(convert.Stats(**convert.PRESETS["tiny"]))
    g = kd.build_ckg(d, "random-walk")
    R, E = d.n_relations, d.n_entities
    assert g.n_relations == 2 + 2 * R and g.n_nodes == E + d.n_users
    assert bool((g.heads[1:] >= g.heads[:-1]).all())                  # sorted by head
    edges = set(zip(g.heads.tolist(), g.rels.tolist(), g.tails.tolist()))
    inverse = {0: 1, 1: 0, **{2 + r: 2 + R + r for r in range(R)}, **{2 + R + r: 2 + r for r in range(R)}}
    assert all((t, inverse[r], h) in edges for h, r, t in edges)
    assert len(g.heads) == 2 * (sum(map(len, d.train)) + len(d.kg))
    key = g.rels * g.n_nodes + g.heads                # the rows of each relation's Laplacian
    rows = torch.zeros(g.n_relations * g.n_nodes, dtype=torch.float64).index_add_(0, key, g.weights.double())
    has = torch.bincount(key, minlength=g.n_relations * g.n_nodes) > 0
    assert torch.allclose(rows[has], torch.ones(int(has.sum()), dtype=torch.float64), atol=1e-6)
    sym = kd.build_ckg(d, "symmetric")
    deg_h = torch.bincount(sym.rels * sym.n_nodes + sym.heads, minlength=sym.n_relations * sym.n_nodes).double()
    deg_t = torch.bincount(sym.rels * sym.n_nodes + sym.tails, minlength=sym.n_relations * sym.n_nodes).double()
    deg = (deg_h[sym.rels * sym.n_nodes + sym.heads] * deg_t[sym.rels * sym.n_nodes + sym.tails])
    assert torch.allclose(sym.weights.double(), 1 / deg.sqrt(), atol=1e-6)


def test_synthetic_matches_requested_statistics():
    stats = convert.Stats(users=500, items=300, entities=900, relations=6, triples=5000, interactions=9000)
    d = convert.synthesize(stats, seed=1)
    assert (d.n_users, d.n_items, d.n_entities, d.n_relations) == (500, 300, 900, 6)
    assert len(d.kg) == 5000 and len(np.unique(d.kg, axis=0)) == 5000
    assert sum(map(len, d.train)) + sum(map(len, d.test)) == 9000
    assert d.kg[:, [0, 2]].max() < 900 and d.kg[:, 1].max() < 6 and all(len(t) >= 1 for t in d.train)
    degree = np.bincount(np.concatenate(d.train), minlength=300)
    assert degree.max() > 5 * np.median(degree)                        # heavy-tailed popularity
    again = convert.synthesize(stats, seed=1)
    assert np.array_equal(again.kg, d.kg)                              # deterministic
    exact = convert.synthesize(convert.Stats(**{**stats.__dict__, "test_interactions": 1234}), seed=1)
    assert sum(map(len, exact.test)) == 1234 and sum(map(len, exact.train)) == 9000 - 1234
    assert all(len(t) >= 1 for t in exact.train)


def fake_ml100k(folder: Path) -> Path:
    """A MovieLens-100K-shaped folder (3 genres) for machines without ../shared/data."""
    rng = np.random.default_rng(0)
    rows = {(int(u), int(i)) for u, i in zip(rng.integers(1, 31, 600), rng.integers(1, 41, 600))}
    write(folder, u__data="".join(f"{u}\t{i}\t4\t{880000000 + k}\n" for k, (u, i) in enumerate(sorted(rows))),
          u__genre="Action|0\nComedy|1\nDrama|2\n\n",
          u__item="".join(f"{i}|Movie {i} (19{50 + i % 3})|01-Jan-19{50 + i % 3}||http://x|{i % 2}|{(i // 2) % 2}|1\n"
                          for i in range(1, 41)))
    return folder


def check_converted(folder: Path, n_users: int, n_items: int, n_ratings: int) -> kd.KGATData:
    d = kd.load(folder)
    assert (d.n_users, d.n_items) == (n_users, n_items)
    n_train, n_test = sum(map(len, d.train)), sum(map(len, d.test))
    assert n_train + n_test == n_ratings and 0.17 < n_test / n_ratings < 0.23     # per-user 80/20
    assert d.n_relations == 2 and set(np.unique(d.kg[:, 1]).tolist()) == {0, 1}
    assert d.kg[:, 0].max() < n_items and d.kg[:, 2].min() >= n_items                # item -> attribute entity
    assert len(np.unique(d.kg[d.kg[:, 1] == 1, 0])) >= 0.99 * n_items               # items with a release year
    return d


def test_convert_movielens_cli_on_a_synthetic_folder(tmp_path):
    src = fake_ml100k(tmp_path / "ml")
    n_ratings = len((src / "u.data").read_text().splitlines())
    proc = subprocess.run([PY, "-m", "trainer", "data", "convert", "movielens-kg", "--src", str(src), "--out",
                           str(tmp_path / "kg")], cwd=REPO, env=clean_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    d = check_converted(tmp_path / "kg", 30, 40, n_ratings)
    assert d.n_entities == 40 + 3 + 3                   # items + genres Action/Comedy/Drama + 3 years
    names = (tmp_path / "kg" / "entity_list.txt").read_text()
    assert "genre:Drama" in names and "year:1951" in names


@pytest.mark.skipif(not (ML100K / "u.item").exists(), reason="../shared/data/ml-100k is not on this machine "
                    "(the synthetic MovieLens-shaped test covers the converter)")
def test_convert_real_movielens_100k(tmp_path):
    data, lists = convert.convert_movielens(ML100K)
    convert.write(data, tmp_path, lists)
    d = check_converted(tmp_path, 943, 1682, 100000)
    assert d.n_entities == 1682 + 19 + len({e for e in lists["entity"] if e.startswith("year:")})


@pytest.mark.parametrize("seed", range(30))
def test_the_array_parser_of_cf_files_equals_the_line_parser(tmp_path, seed, caplog):
    """read_cf's array path against its line-by-line one on random files: blank lines, users with no items,
    repeated items, users out of order, a BOM; the same users, items and duplicate warning."""
    rng = np.random.default_rng(seed)
    users = rng.permutation(12)[:int(rng.integers(1, 12))]
    lines = [" ".join(map(str, [u, *rng.integers(0, 9, int(rng.integers(0, 6)))])) for u in users]
    lines = [x for line in lines for x in ([line, ""] if rng.random() < 0.2 else [line])]
    path = tmp_path / "train.txt"
    path.write_bytes((b"\xef\xbb\xbf" if seed % 5 == 0 else b"") + ("\n".join(lines) + "\n").encode())
    for policy in ("drop", "keep"):
        caplog.clear()
        fast = kd._read_cf_fast(path, policy)
        fast_log = caplog.text
        caplog.clear()
        slow = kd._read_cf_lines(path, policy)
        assert fast is not None and list(fast) == list(slow)
        assert all(fast[u].tolist() == slow[u].tolist() for u in slow)
        assert fast_log.split(": ", 1)[-1] == caplog.text.split(": ", 1)[-1]

"""KGAT's interactions from Parquet (issue 55): train.parquet/test.parquet, one (user, item) per row, stand for
train.txt/test.txt; the same data as the text folder, through the cache too; duplicates named by row; ids that are
names and a missing column refused in one line."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from trainer.recipes.kgat import convert
from trainer.recipes.kgat import data as KD

pa = pytest.importorskip("pyarrow", reason="the `parquet` extra is not installed here: KGAT's Parquet input untested")
import pyarrow.parquet as pq  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("kgpq")
    text = convert.write(convert.synthesize(convert.Stats(**convert.PRESETS["tiny"]), seed=0), root / "text")
    parquet = root / "parquet"
    shutil.copytree(text, parquet)
    for name in ("train", "test"):
        rows = KD.read_cf(text / f"{name}.txt")                  # UserRows: users, offsets, items
        users, items = np.repeat(rows.users, np.diff(rows.offsets)), rows.items
        shuffle = np.random.default_rng(0).permutation(len(users))     # any row order
        pq.write_table(pa.table(dict(uid=users[shuffle], item=items[shuffle])), parquet / f"{name}.parquet")
        (parquet / f"{name}.txt").unlink()
    return text, parquet


def test_parquet_interactions_give_the_text_folders_data(folders, tmp_path):
    text, parquet = folders
    want = KD.load(text)
    with pytest.raises(KD.DataError, match=r"train.parquet: no column 'user' \(it has uid, item\); "
                                           r"data.user_column=NAME names another"):
        KD.load(parquet)
    for got in (KD.load(parquet, columns=("uid", "")),
                KD.load_cached(parquet, cache_setting=str(tmp_path / "cache"), columns=("uid", "")),
                KD.load_cached(parquet, cache_setting=str(tmp_path / "cache"), columns=("uid", ""))):
        for split in ("train", "test"):
            assert np.array_equal(getattr(got, split).flat, getattr(want, split).flat)
            assert np.array_equal(getattr(got, split).offsets, getattr(want, split).offsets)
        assert (got.n_items, got.n_entities, got.n_relations) == (want.n_items, want.n_entities, want.n_relations)


def test_parquet_duplicates_are_named_by_row_and_names_refused(tmp_path, caplog):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "kg_final.txt").write_text("0 0 3\n1 0 3\n")
    pq.write_table(pa.table(dict(user=[0, 0, 1, 0], item=[1, 2, 0, 1])), folder / "train.parquet")
    pq.write_table(pa.table(dict(user=[1], item=[2])), folder / "test.parquet")
    with pytest.raises(KD.DataError, match=r"train.parquet: 1 duplicate interaction\(s\) .* first at row 3"):
        KD.load(folder, duplicates="error")
    assert [r.tolist() for r in KD.load(folder).train] == [[1, 2], [0]]
    pq.write_table(pa.table(dict(user=["a", "b"], item=[1, 2])), folder / "train.parquet")
    with pytest.raises(KD.DataError, match="user and item ids must be integers >= 0 here"):
        KD.load(folder)

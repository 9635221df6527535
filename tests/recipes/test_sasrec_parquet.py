"""SASRec's data from Parquet (a file or a folder of them) and Arrow/Feather files (the `parquet` extra): the same
interactions as the u.data they were written from, columns found by their usual names or data.*_column, a bad
value named by file, column and row, the missing extra named in one line, and a training run from Parquet."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO, clean_env
from tests.inprocess import cli
from trainer.engine.logging import read_metrics
from trainer.recipes.sasrec import data as D

pa = pytest.importorskip("pyarrow", reason="pyarrow (the parquet extra) is not installed: make setup installs it")
import pyarrow.feather as feather  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402


@pytest.fixture(scope="module")
def inter():
    return D.synthesize(60, 40, 12, seed=3)


def table(inter, names=("user_id", "item_id", "timestamp")):
    return pa.table({names[0]: inter.user_ids, names[1]: inter.item_ids, names[2]: inter.times})


def same(a, b):
    for x, y in ((a.seqs, b.seqs), (a.times, b.times)):
        assert np.array_equal(x.flat, y.flat) and np.array_equal(x.offsets, y.offsets)


def test_parquet_file_folder_and_feather_read_as_the_udata(tmp_path, inter):
    ref = D.build_sequences(D.read_interactions(D.write_udata(inter, tmp_path / "u.data")))
    pq.write_table(table(inter), tmp_path / "one.parquet")
    (tmp_path / "parts").mkdir()
    half = len(inter) // 2
    pq.write_table(table(inter).slice(0, half), tmp_path / "parts" / "a.parquet")
    pq.write_table(table(inter).slice(half), tmp_path / "parts" / "b.parquet")
    feather.write_feather(table(inter), tmp_path / "x.feather")
    for path in ("one.parquet", "parts", "x.feather"):
        same(D.build_sequences(D.read_interactions(tmp_path / path)), ref)


def test_columns_by_name_and_their_errors(tmp_path, inter):
    pq.write_table(table(inter, ("who", "what", "when")), tmp_path / "x.parquet")
    with pytest.raises(D.DataError, match=r"x.parquet: header .* names no user column .*data.user_column=NAME"):
        D.read_interactions(tmp_path / "x.parquet")
    got = D.read_interactions(tmp_path / "x.parquet", columns=("who", "What", "when"))
    assert np.array_equal(got.user_ids, inter.user_ids) and np.array_equal(got.times, inter.times)


@pytest.mark.parametrize("column,values,message", [
    ("user_id", lambda n: pa.array([1] * (n - 1) + [None], pa.int64()), r"column 'user_id': row \d+ is null"),
    ("item_id", lambda n: pa.array([2] * (n - 1) + [-4], pa.int64()), r"column 'item_id': row \d+: -4 is a negative"),
    ("item_id", lambda n: pa.array([2.0] * (n - 1) + [2.5]), r"column 'item_id': row \d+: 2.5 is not an integer id"),
])
def test_a_bad_value_is_named_by_file_column_and_row(tmp_path, inter, column, values, message):
    t = table(inter)
    t = t.set_column(t.schema.get_field_index(column), column, values(len(inter)))
    pq.write_table(t, tmp_path / "bad.parquet")
    with pytest.raises(D.DataError, match=rf"bad.parquet: {message}"):
        D.read_interactions(tmp_path / "bad.parquet")


def test_without_pyarrow_the_extra_is_named(tmp_path, inter):
    pq.write_table(table(inter), tmp_path / "x.parquet")
    code = ("import sys; sys.modules['pyarrow'] = None\nfrom trainer.recipes.sasrec import data as D\n"
            f"D.read_interactions({str(tmp_path / 'x.parquet')!r})")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True)
    assert proc.returncode != 0 and "hpc-trainer[parquet]" in proc.stderr


def test_training_from_parquet(tmp_path, inter):
    pq.write_table(table(inter), tmp_path / "x.parquet")
    cli("train", "--recipe", "sasrec", "--epochs", "1", f"data.path={tmp_path / 'x.parquet'}",
            f"data.cache={tmp_path / 'cache'}", "data.maxlen=10", "model.width=16", "log.tensorboard=false",
            "--run-dir", str(tmp_path / "run"))
    assert read_metrics(tmp_path / "run", "test") and list((tmp_path / "cache").glob("sasrec-*/manifest.json"))

"""Interactions as users have them (issue 73 point 3): a CSV whose time column is date-time text is read as a
Parquet datetime column is, in the same order; text that is not a time is refused naming the line, the accepted
forms and data.time_column; a folder with two candidate files stops naming both; MovieLens-style folders (u.data
beside u.item, ...) still resolve alone."""
from __future__ import annotations

import numpy as np
import pytest

from trainer.recipes.sasrec import data as D
from trainer.recipes.sasrec.read import FOLDER_FILES, datetime_seconds

ROWS = [(1, 10, "1997-09-22 21:57:58"), (1, 11, "1997-09-23T10:00:00"), (2, 10, "1997-09-22T21:57:58Z"),
        (2, 12, "1997-09-24"), (2, 13, "1997-09-24T01:00:00+02:00")]


def write_csv(path, rows, header="user_id,item_id,timestamp"):
    path.write_text(header + "\n" + "".join(f"{u},{i},{t}\n" for u, i, t in rows))
    return path


def test_iso_date_times_in_a_csv_are_read_as_seconds_and_match_parquet(tmp_path):
    data = D.read_interactions(write_csv(tmp_path / "a.csv", ROWS))
    expected = [np.datetime64(t.replace("Z", "").replace("+02:00", ""), "s").astype(np.int64) for _, _, t in ROWS]
    expected[-1] -= 2 * 3600                                          # +02:00: two hours earlier in UTC
    assert data.times.tolist() == expected and data.user_ids.tolist() == [1, 1, 2, 2, 2]
    pa = pytest.importorskip("pyarrow", reason="the parquet extra is not installed: the Parquet half is skipped")
    import pyarrow.parquet as pq
    stamps = np.asarray(expected, dtype="datetime64[s]")
    pq.write_table(pa.table({"user_id": [1, 1, 2, 2, 2], "item_id": [10, 11, 10, 12, 13], "timestamp": stamps}),
                   tmp_path / "a.parquet")
    from_parquet = D.read_interactions(tmp_path / "a.parquet")
    assert np.argsort(from_parquet.times, kind="stable").tolist() == np.argsort(data.times, kind="stable").tolist()
    unit = from_parquet.times[0] // data.times[0]                    # Parquet keeps its own unit (ms here)
    assert unit in (1, 1000) and (from_parquet.times == data.times * unit).all()


def test_a_time_that_is_not_one_names_the_line_the_forms_and_the_setting(tmp_path):
    bad = write_csv(tmp_path / "b.csv", [*ROWS[:2], (3, 14, "22/09/1997 10:00")])
    with pytest.raises(D.DataError) as err:
        D.read_interactions(bad)
    text = str(err.value)
    assert text.startswith(f"{bad}:4: field 'timestamp': '22/09/1997 10:00' is not a time")
    assert "ISO 8601" in text and "1997-09-22 21:57:58" in text and "data.time_column=NAME" in text
    assert datetime_seconds(np.asarray(["", "1997-09-22"])) is None  # an empty time is not one


def test_integer_times_are_unchanged(tmp_path):
    data = D.read_interactions(write_csv(tmp_path / "c.csv", [(1, 10, 874965478), (1, 11, 875008800)]))
    assert data.times.tolist() == [874965478, 875008800]


def test_a_folder_with_two_candidates_stops_naming_both(tmp_path):
    write_csv(tmp_path / "interactions.csv", ROWS)
    (tmp_path / "u.data").write_text("1\t10\t5\t100\n")
    with pytest.raises(D.DataError, match=r"more than one interactions file: u\.data, interactions\.csv; set "
                                          r"data\.path to the one to read"):
        D.read_interactions(tmp_path)
    (tmp_path / "u.data").unlink()
    (tmp_path / "ratings.parquet").write_bytes(b"")                  # its contents are not read to refuse
    with pytest.raises(D.DataError, match=r"interactions\.csv, 1 \.parquet file\(s\)"):
        D.read_interactions(tmp_path)


def test_a_movielens_folder_resolves_to_its_ratings_file(tmp_path):
    (tmp_path / "u.data").write_text("1\t10\t5\t100\n1\t11\t4\t101\n")
    for name in ("u.item", "u.user", "README"):
        (tmp_path / name).write_text("x\n")
    assert D.resolve_path(tmp_path) == tmp_path / "u.data"
    assert "u.data" in FOLDER_FILES

"""Inputs that cannot silently ruin a run (issue 46, point 5): non-finite values, ids written as floats,
duplicate interactions, a BOM, duplicate YAML keys, and the raw tracebacks of the issue's list, each a one-line
error naming the file and what to do."""
import time

import numpy as np
import pytest

from tests.conftest import record_fault
from tests.inprocess import cli
from trainer.config.settings import ConfigError, load_yaml
from trainer.recipes.har import data as HAR
from trainer.recipes.kgat import data as KG
from trainer.recipes.sasrec import data as SEQ

TS_HEAD = "@problemName tiny\n@timeStamps false\n@univariate false\n@dimensions 2\n@classLabel true a b\n@data\n"


def ts_file(path, cases):
    path.write_text(TS_HEAD + "".join(f"{c}\n" for c in cases))
    return path


def cli_error(*args):
    """A CLI call that must fail with exit 2 and one clean error (no traceback); its stderr."""
    out = cli(*args, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    return out.stderr


# ---------------------------------------------------------------------------------------- non-finite values

@pytest.mark.parametrize("token", ["inf", "-Infinity", "nan", "1e308"])
def test_a_non_finite_value_in_a_ts_file_is_refused_with_file_and_line(tmp_path, token):
    path = ts_file(tmp_path / "x_TRAIN.ts", ["1,2,3:4,5,6:a", f"1,2,3:4,{token},6:b"])
    with pytest.raises(HAR.DataError, match=r"x_TRAIN.ts:8: field 'dimension 2 value 2': .* is not a finite"):
        HAR.read_ts(path)


def test_missing_values_of_the_ts_format_still_read_as_missing(tmp_path):
    series = HAR.read_ts(ts_file(tmp_path / "x_TRAIN.ts", ["1,?,3:4,5,6:a"]))
    assert np.isnan(series.samples[0][0, 1]) and np.isfinite(series.samples[0][1]).all()


def test_an_inf_in_a_ts_file_stops_training_before_it_starts(tmp_path):
    """The issue's run: one inf in a HAR .ts file gave exit 0 at chance accuracy."""
    ts_file(tmp_path / "x_TRAIN.ts", [f"1,2,{'inf' if i == 3 else i}:4,5,6:{'ab'[i % 2]}" for i in range(8)])
    t0 = time.monotonic()
    err = cli_error("train", "--recipe", "har", "--epochs", "1", f"data.path={tmp_path}", "--run-dir",
                    str(tmp_path / "run"))
    assert f"{tmp_path / 'x_TRAIN.ts'}:10: field 'dimension 1 value 3': inf is not a finite number" in err
    record_fault("one inf in a HAR .ts file", steps_lost=0, exit_s=round(time.monotonic() - t0, 2),
                 outcome="exit 2 naming file:line and field (was: exit 0 at chance accuracy)")


def test_an_id_written_as_a_float_stops_training_with_file_and_line(tmp_path):
    udata(tmp_path / "u.data", [f"{u}\t{i}\t5\t{100 + i}" for u in (1, 2) for i in range(1, 6)] + ["1.0\t7\t4\t200"])
    t0 = time.monotonic()
    err = cli_error("train", "--recipe", "sasrec", "--epochs", "1", f"data.path={tmp_path / 'u.data'}",
                    "--run-dir", str(tmp_path / "run"))
    assert f"{tmp_path / 'u.data'}:11: field 'user': '1.0' is not an integer id" in err
    record_fault("an id written 1.0 in u.data (sasrec)", steps_lost=0, exit_s=round(time.monotonic() - t0, 2),
                 outcome="exit 2 naming file:line and field (was: a second user)")


def test_uci_matrices_and_arrays_refuse_non_finite_values(tmp_path):
    (tmp_path / "m.txt").write_text("1 2\n3 inf\n")
    with pytest.raises(HAR.DataError, match=r"m.txt:2: field 'value 2': inf is not a finite number"):
        HAR._matrix(tmp_path / "m.txt", 2)
    x = np.zeros((3, 2, 4), np.float32)
    x[1, 0, 2] = np.nan
    np.savez(tmp_path / "a.npz", samples=x, labels=np.arange(3))
    with pytest.raises(HAR.DataError, match=r"a.npz: field 'samples'\[1, 0, 2\] = .*nan.* is not a finite"):
        HAR.read_arrays(tmp_path / "a.npz")


# ------------------------------------------------------------------------------------------ ids and rows

def udata(path, rows, bom=False):
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + "".join(f"{r}\n" for r in rows).encode())
    return path


@pytest.mark.parametrize("bad,why", [("1.0", "not an integer id"), ("-3", "a negative id"), ("x7", "not an integer")])
def test_an_id_of_u_data_must_be_written_as_a_whole_number(tmp_path, bad, why):
    path = udata(tmp_path / "u.data", ["1\t10\t5\t100", f"{bad}\t11\t4\t101"])
    with pytest.raises(SEQ.DataError, match=rf"u.data:2: field 'user': '{bad}' is {why}"):
        SEQ.read_interactions(path)


def test_csv_ids_stay_strings(tmp_path):
    (tmp_path / "r.csv").write_text("user,item,timestamp\n1.0,a,1\n1,a,2\n")
    inter = SEQ.read_interactions(tmp_path / "r.csv")
    assert inter.users == ["1.0", "1"]           # two users: a CSV's ids are names


def test_a_bom_is_stripped(tmp_path):
    path = udata(tmp_path / "u.data", ["1\t10\t5\t100", "1\t11\t4\t101"], bom=True)
    assert SEQ.read_interactions(path).users == ["1", "1"]
    (tmp_path / "kg").mkdir()
    (tmp_path / "kg" / "train.txt").write_bytes(b"\xef\xbb\xbf0 1 2\n1 2\n")
    assert sorted(KG.read_cf(tmp_path / "kg" / "train.txt")) == [0, 1]


def test_duplicate_interactions_are_dropped_with_a_count_kept_or_refused(tmp_path, caplog):
    rows = ["1\t10\t5\t100", "1\t11\t4\t101", "1\t10\t5\t100", "2\t10\t3\t100", "1\t10\t5\t100"]
    path = udata(tmp_path / "u.data", rows)
    dropped = SEQ.read_interactions(path)
    assert len(dropped.users) == 3
    assert "2 duplicate interaction(s) (the same user, item and time), first at line 3 (repeating line 1)" \
        in caplog.text and "dropped" in caplog.text
    assert len(SEQ.read_interactions(path, duplicates="keep").users) == 5
    with pytest.raises(SEQ.DataError, match="2 duplicate interaction"):
        SEQ.read_interactions(path, duplicates="error")
    (tmp_path / "train.txt").write_text("0 1 2 1\n1 3 3 3\n")
    assert KG.read_cf(tmp_path / "train.txt")[1].tolist() == [3]
    assert "3 duplicate interaction(s) (an item repeated on its user's line), first at line 1" in caplog.text
    assert KG.read_cf(tmp_path / "train.txt", "keep")[1].tolist() == [3, 3, 3]
    with pytest.raises(KG.DataError, match="first at line 1"):
        KG.read_cf(tmp_path / "train.txt", "error")


def test_kgat_ids_written_as_floats_are_refused(tmp_path):
    (tmp_path / "train.txt").write_text("0 1 2\n1.0 3\n")
    with pytest.raises(KG.DataError, match=r"train.txt:2: field 'user': '1.0' is not an integer"):
        KG.read_cf(tmp_path / "train.txt")


# ----------------------------------------------------------------------------------- files and configs

def test_not_utf8_data_and_config_files_name_the_file_and_line(tmp_path):
    path = tmp_path / "x_TRAIN.ts"
    path.write_bytes(TS_HEAD.encode() + b"1,2,3:4,5,6:a\n# caf\xe9\n")
    with pytest.raises(HAR.DataError, match=r"x_TRAIN.ts:8: not UTF-8 text \(byte 0xe9"):
        HAR.read_ts(path)
    (tmp_path / "c.yaml").write_bytes(b"train:\n  epochs: 1 # caf\xe9\n")
    with pytest.raises(ConfigError, match=r"c.yaml: not UTF-8 text \(byte 0xe9"):
        load_yaml(tmp_path / "c.yaml")


def test_a_duplicate_yaml_key_or_section_is_refused_with_file_and_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  epochs: 1\nmodel:\n  hidden: 8\ntrain:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=rf"{path}:5: key 'train' given twice \(first at line 1\)"):
        load_yaml(path)
    path.write_text("train:\n  epochs: 1\n  epochs: 2\n")
    with pytest.raises(ConfigError, match=rf"{path}:3: key 'epochs' given twice"):
        load_yaml(path)


def test_the_issues_tracebacks_are_one_line_errors(tmp_path):
    assert "--config" in cli_error("train", "--recipe", "har", "--config", str(tmp_path), "--print-config")
    (tmp_path / "d" / "x_TRAIN.ts").mkdir(parents=True)
    err = cli_error("train", "--recipe", "har", "--epochs", "1", f"data.path={tmp_path / 'd'}", "--run-dir",
                    str(tmp_path / "run"))
    assert f"{tmp_path / 'd' / 'x_TRAIN.ts'} is a directory; expected a data file" in err
    err = cli_error("train", "--recipe", "video", "data.merge={a: b", "--print-config")
    assert "data.merge: '{a: b' is not valid YAML" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "ckdir").mkdir()
    assert f"checkpoint {tmp_path / 'ckdir'}: no checkpoint in it" in cli_error("eval", "--checkpoint",
                                                                                 str(tmp_path / "ckdir"))
    (tmp_path / "ckdir" / "notes.pt").write_bytes(b"x")      # a folder of .pt files, not a run directory
    assert f"checkpoint {tmp_path / 'ckdir'} is a directory" in cli_error("eval", "--checkpoint",
                                                                              str(tmp_path / "ckdir"))


def test_a_plugin_that_raises_on_import_is_named_and_doctor_still_runs(tmp_path):
    (tmp_path / "badplug.py").write_text("x = 1\nraise RuntimeError('boom in the plugin')\n")
    from tests.conftest import clean_env, trainer
    env = clean_env(PYTHONPATH=str(tmp_path), TRAINER_PLUGINS="badplug")
    out = trainer("doctor", env=env)            # a process: PYTHONPATH is what finds the plugin
    assert "TRAINER_PLUGINS module 'badplug' raised RuntimeError: boom in the plugin at " in out.stderr
    assert f"{tmp_path / 'badplug.py'}:2" in out.stderr and "world size: 1" in out.stdout + out.stderr

"""HAR `.ts` parser: the real BasicMotions files (when ../shared is there), unequal lengths, missing values,
and errors that name the file, line and field."""
import math

import numpy as np
import pytest
import torch

from tests.conftest import REPO
from trainer.recipes.har.data import DataError, read_ts

BASIC = REPO.parent / "shared" / "data" / "BasicMotions"
HEADER = "#comment\n@problemName toy\n@univariate false\n@dimensions 2\n@equalLength false\n" \
         "@classLabel true walk run\n@data\n"


def write(tmp_path, body: str, header: str = HEADER):
    path = tmp_path / "toy.ts"
    path.write_text(header + body)
    return path


def test_unequal_lengths_missing_values_and_labels(tmp_path):
    s = read_ts(write(tmp_path, "1,2,3:4,5,6:run\n\n0.5,?:1e-3,-2:walk\n"))
    assert s.class_names == ["walk", "run"] and s.labels.tolist() == [1, 0]
    assert s.channels == 2 and s.lengths.tolist() == [3, 2]
    assert s.samples[0].tolist() == [[1, 2, 3], [4, 5, 6]] and s.samples[0].dtype == np.float32
    assert math.isnan(s.samples[1][0, 1]) and s.samples[1][1, 0] == pytest.approx(1e-3)
    assert s.header["problemname"] == "toy"


@pytest.mark.parametrize("body,header,message", [
    ("1,2:3,x:run\n", HEADER, "toy.ts:8: field 'dimension 2 value 2': 'x' is not a number"),
    ("1,2:3,4:jump\n", HEADER, "toy.ts:8: field 'class label': 'jump' is not one of @classLabel walk run"),
    ("1,2:run\n", HEADER, "toy.ts:8: 1 dimensions, @dimensions says 2"),
    ("1,2:3:run\n", HEADER, "toy.ts:8: the dimensions of one case differ in length (2, 1)"),
    ("", HEADER, "toy.ts: no cases after @data"),
    ("1,2:3,4:run\n", "@dimensions 2\n@classLabel true walk run\n", "toy.ts:3: expected a @directive or @data"),
    ("", "@dimensions 2\n@classLabel true walk run\n", "toy.ts: no @data line"),
    ("", "@classLabel maybe\n@data\n", "@classLabel must be true or false"),
    ("", "1,2\n", "toy.ts:1: expected a @directive or @data"),
])
def test_errors_name_file_line_and_field(tmp_path, body, header, message):
    with pytest.raises(DataError) as err:
        read_ts(write(tmp_path, body, header))
    assert message in str(err.value)


def test_real_basic_motions(tmp_path):
    if not BASIC.exists():
        print(f"{BASIC} missing: checking a synthetic file of the same shape instead")
        rng = np.random.default_rng(0)
        header = "@dimensions 6\n@equalLength true\n@seriesLength 100\n" \
                 "@classLabel true Standing Running Walking Badminton\n@data\n"
        names = ["Standing", "Running", "Walking", "Badminton"]
        body = "".join(":".join(",".join(f"{v:.4f}" for v in rng.normal(size=100)) for _ in range(6))
                       + f":{names[i % 4]}\n" for i in range(40))
        path = write(tmp_path, body, header)
    else:
        path = BASIC / "BasicMotions_TRAIN.ts"
    s = read_ts(path)
    assert len(s.samples) == 40 and s.channels == 6 and set(s.lengths.tolist()) == {100}
    assert s.class_names == ["Standing", "Running", "Walking", "Badminton"]
    assert np.bincount(s.labels).tolist() == [10, 10, 10, 10]
    assert all(np.isfinite(x).all() for x in s.samples)


# ------------------------------------------------------------------ UCI HAR layout

from trainer.recipes.har import data as hd  # noqa: E402
from trainer.recipes.har.prepare import HARDataConfig, channel_stats, load, to_windows  # noqa: E402


def uci_dir(tmp_path, n=30):
    root = tmp_path / "UCI HAR Dataset"
    s = hd.synthesize(n=n, classes=6, subjects=5, seed=3)
    s.class_names = list(hd.UCI_ACTIVITIES)
    test = hd.synthesize(n=12, classes=6, subjects=2, seed=4)
    test.class_names = s.class_names
    hd.write_uci_har(root, "train", s)
    hd.write_uci_har(root, "test", test)
    return root, s


def test_uci_har_layout_reads_nine_signals_labels_and_subjects(tmp_path):
    root, s = uci_dir(tmp_path)
    got = hd.read_uci_har(tmp_path, "train")          # the parent folder is accepted too
    assert got.class_names == list(hd.UCI_ACTIVITIES) and got.channels == 9
    assert np.array_equal(got.labels, s.labels) and np.array_equal(got.subjects, s.subjects)
    np.testing.assert_allclose(np.stack(got.samples), np.stack(s.samples), rtol=1e-6)
    # channel order is the documented one: body_acc xyz, body_gyro xyz, total_acc xyz
    row = np.loadtxt(root / "train" / "Inertial Signals" / "body_gyro_y_train.txt")[2]
    np.testing.assert_allclose(got.samples[2][hd.UCI_SIGNALS.index("body_gyro_y")], row, rtol=1e-6)


@pytest.mark.parametrize("target,edit,message", [
    ("train/y_train.txt", lambda t: t.replace("\n", "\n7\n", 1),
     "y_train.txt:2: field 'activity': 7 is not an integer in 1..6"),
    ("train/subject_train.txt", lambda t: "0\n" + t.split("\n", 1)[1], "subject_train.txt:1: field 'subject': 0"),
    ("train/Inertial Signals/total_acc_z_train.txt", lambda t: t.replace("e", "x", 1),
     "total_acc_z_train.txt:1: field 'value 1'"),
    ("train/Inertial Signals/body_acc_x_train.txt", lambda t: "\n".join(t.split("\n")[:3]) + "\n1 2\n",
     "body_acc_x_train.txt:4: 2 values, expected 128"),
    ("train/Inertial Signals/body_acc_y_train.txt", lambda t: "\n".join(t.split("\n")[:5]) + "\n",
     "body_acc_y_train.txt: 5 lines, but y_train.txt has 30"),
    ("activity_labels.txt", lambda t: "1 WALKING\n3 SITTING\n", "activity_labels.txt:2: expected '2 NAME'"),
])
def test_uci_har_errors_name_file_line_and_field(tmp_path, target, edit, message):
    root, _ = uci_dir(tmp_path)
    path = root / target
    path.write_text(edit(path.read_text()))
    with pytest.raises(DataError) as err:
        hd.read_uci_har(root, "train")
    assert message in str(err.value)


def test_uci_har_missing_file_and_wrong_folder(tmp_path):
    root, _ = uci_dir(tmp_path)
    (root / "train" / "Inertial Signals" / "body_gyro_x_train.txt").unlink()
    with pytest.raises(DataError, match="body_gyro_x_train.txt: missing"):
        hd.read_uci_har(root, "train")
    with pytest.raises(DataError, match="not a UCI HAR folder"):
        hd.read_uci_har(tmp_path / "elsewhere", "train")


# ------------------------------------------------------------------ arrays

def test_arrays_npz_and_pt_with_a_validation_file(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in (("train", 20), ("val", 6), ("test", 8)):
        x, y = rng.normal(size=(n, 3, 50)).astype(np.float32), np.arange(n) % 4
        if split == "val":
            torch.save({"samples": torch.from_numpy(x), "labels": torch.from_numpy(y)}, tmp_path / f"{split}.pt")
        else:
            np.savez(tmp_path / f"{split}.npz", samples=x, labels=y)
    data = load(HARDataConfig(path=str(tmp_path)))
    assert {k: len(v) for k, v in data.splits.items()} == {"train": 20, "val": 6, "test": 8}   # val file kept
    assert data.class_names == ["0", "1", "2", "3"] and data.splits["train"].x.shape == (20, 3, 50)


@pytest.mark.parametrize("arrays,message", [
    ({"samples": np.zeros((4, 3)), "labels": np.zeros(4)}, "field 'samples' has shape (4, 3), expected [N, C, T]"),
    ({"samples": np.zeros((4, 2, 5)), "labels": np.zeros(3)}, "field 'labels' has shape (3,), expected [4]"),
    ({"samples": np.zeros((4, 2, 5))}, "field 'labels' missing (found samples)"),
    ({"samples": np.zeros((2, 2, 5)), "labels": np.array([0, -1])}, "field 'labels'[1] = -1 is not a class index"),
    ({"samples": np.zeros((2, 2, 5)), "labels": np.array([0, 1.5])}, "field 'labels'[1] = 1.5"),
])
def test_array_errors_name_file_and_field(tmp_path, arrays, message):
    np.savez(tmp_path / "train.npz", **arrays)
    with pytest.raises(DataError) as err:
        hd.read_arrays(tmp_path / "train.npz")
    assert "train.npz" in str(err.value) and message in str(err.value)


def test_truncated_pt_file_is_reported(tmp_path):
    torch.save({"samples": torch.zeros(4, 2, 5), "labels": torch.zeros(4)}, tmp_path / "train.pt")
    blob = (tmp_path / "train.pt").read_bytes()
    (tmp_path / "train.pt").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(DataError, match="train.pt: cannot be read as a tensor file"):
        hd.read_arrays(tmp_path / "train.pt")


# ------------------------------------------------------------------ splits, standardisation, lengths

def test_validation_split_by_subject_has_no_leakage(tmp_path):
    uci_dir(tmp_path, n=120)
    data = load(HARDataConfig(path=str(tmp_path), val_fraction=0.3), seed=2)
    train, val = data.splits["train"], data.splits["val"]
    assert set(train.subjects.tolist()).isdisjoint(val.subjects.tolist())
    assert len(train) + len(val) == 120 and 0.15 < len(val) / 120 < 0.6
    strat = load(HARDataConfig(path=str(tmp_path), val_fraction=0.25, val_split="stratified"), seed=2)
    val_counts = np.bincount(strat.splits["val"].y.numpy(), minlength=6)
    assert val_counts.tolist() == [5] * 6            # 20 per class -> 5 of each held out


def test_stratified_split_without_subjects_and_subject_request_fails(tmp_path):
    if BASIC.exists():
        path = BASIC
    else:
        s = hd.synthesize(n=40, channels=6, length=100, classes=4)
        np.savez(tmp_path / "train.npz", samples=np.stack(s.samples), labels=s.labels)
        path = tmp_path
    data = load(HARDataConfig(path=str(path), val_fraction=0.2))
    assert np.bincount(data.splits["val"].y.numpy()).tolist() == [2, 2, 2, 2]
    with pytest.raises(DataError, match="val_split=subject, but the dataset records no subjects"):
        load(HARDataConfig(path=str(path), val_split="subject"))


def test_standardisation_uses_training_statistics_only(tmp_path):
    rng = np.random.default_rng(1)
    train = rng.normal(3.0, 2.0, size=(30, 2, 40)).astype(np.float32)
    test = rng.normal(-50.0, 9.0, size=(10, 2, 40)).astype(np.float32)    # far away: must not leak
    np.savez(tmp_path / "train.npz", samples=train, labels=np.arange(30) % 2)
    np.savez(tmp_path / "test.npz", samples=test, labels=np.arange(10) % 2)
    data = load(HARDataConfig(path=str(tmp_path), val_fraction=0.2, val_split="stratified"))
    kept = data.splits["train"].x.numpy()
    np.testing.assert_allclose(kept.mean(axis=(0, 2)), 0, atol=1e-4)
    np.testing.assert_allclose(kept.std(axis=(0, 2)), 1, atol=1e-3)
    expected = (test - data.mean[None, :, None]) / data.std[None, :, None]
    np.testing.assert_allclose(data.splits["test"].x.numpy(), expected, rtol=1e-5, atol=1e-5)
    assert abs(data.mean[0] - 3.0) < 0.3 and data.splits["test"].x.mean() < -20


def test_unequal_lengths_and_missing_values_pad_with_lengths_or_resample(tmp_path):
    path = write(tmp_path, "1,2,3,4:5,6,7,8:run\n1,?:3,4:walk\n0,0,0:1,1,1:walk\n2,2:5,5:run\n")
    s = read_ts(path)
    mean, std = channel_stats(s)
    assert mean[0] == pytest.approx(np.mean([1, 2, 3, 4, 1, 0, 0, 0, 2, 2]))     # '?' left out
    w = to_windows(s, mean, std, 4, "pad")
    assert w.lengths.tolist() == [4, 2, 3, 2] and w.x.shape == (4, 2, 4)
    assert w.x[1, 0, 1] == 0 and w.x[1, :, 2:].abs().sum() == 0                  # missing -> mean, padding zero
    r = to_windows(s, np.zeros(2, np.float32), np.ones(2, np.float32), 7, "resample")
    assert r.lengths.tolist() == [7] * 4
    np.testing.assert_allclose(r.x[0, 0].numpy(), np.linspace(1, 4, 7), rtol=1e-6)
    np.testing.assert_allclose(r.x[1, 0].numpy(), np.full(7, 1.0))               # one observed value


def test_flat_series_windows_match_a_case_by_case_reference():
    """Series keeps a split as one flat array; take() and the pad/truncate windows equal what one array per case
    gives (unequal lengths, a NaN, a case longer than the window)."""
    rng = np.random.default_rng(0)
    cases = [rng.normal(size=(3, n)).astype(np.float32) for n in (5, 9, 2, 7)]
    cases[1][2, 4] = np.nan
    s = hd.Series.of(cases, np.array([0, 1, 0, 1]), ["a", "b"], subjects=np.array([1, 2, 3, 4]))
    assert len(s) == 4 and s.lengths.tolist() == [5, 9, 2, 7] and s.values.shape == (3, 23)
    part = s.take(np.array([3, 1]))
    assert np.array_equal(part.samples[0], cases[3]) and np.allclose(part.samples[1], cases[1], equal_nan=True)
    assert part.subjects.tolist() == [4, 2] and part.labels.tolist() == [1, 1]
    mean, std = np.array([0.5, -1, 2], np.float32), np.array([2, 1, 4], np.float32)
    w = to_windows(s, mean, std, 6, "pad")
    for i, case in enumerate(cases):
        t = min(case.shape[1], 6)
        ref = np.zeros((3, 6), np.float32)
        ref[:, :t] = np.nan_to_num((case[:, :t] - mean[:, None]) / std[:, None], nan=0.0)
        np.testing.assert_allclose(w.x[i].numpy(), ref, rtol=1e-6)
        assert int(w.lengths[i]) == t

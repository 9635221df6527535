"""HAR `.ts` parser: the real BasicMotions files (when ../shared is there), unequal lengths, missing values,
and errors that name the file, line and field."""
import math

import numpy as np
import pytest

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

"""Issue 57: ids that size a table are bounded. One stray large id in a KGAT folder (a triple `0 7 999999`, an
item 999999) or a class index 999 in an array file stops the run before the model is built, naming the file, line,
id and how much of the table is used; data.remap_ids=true compacts KGAT's ids instead, and the maps travel with
the run directory and every checkpoint (eval of a copied checkpoint works; other data is refused)."""
import shutil
import time

import numpy as np
import pytest
import torch

from tests.conftest import record_fault
from tests.inprocess import cli
from trainer.data.flat import MAX_UNUSED, TABLE_FLOOR
from trainer.recipes.har import data as HD
from trainer.recipes.kgat import convert
from trainer.recipes.kgat import data as KD


@pytest.fixture(scope="module")
def kgat_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("kg")
    return convert.write(convert.synthesize(convert.Stats(**convert.PRESETS["tiny"]), seed=0), root / "tiny")


def sparse_copy(folder, tmp_path, kg_line: str = "", train_line: str = ""):
    out = tmp_path / "sparse"
    shutil.copytree(folder, out)
    for name in ("item_list.txt", "entity_list.txt"):
        (out / name).unlink()                          # optional: the ids alone size the tables
    if kg_line:
        with open(out / "kg_final.txt", "a") as fh:
            fh.write(kg_line + "\n")
    if train_line:
        with open(out / "train.txt", "a") as fh:
            fh.write(train_line + "\n")
    return out


def test_a_stray_entity_id_is_refused_with_its_line(kgat_folder, tmp_path):
    folder = sparse_copy(kgat_folder, tmp_path, kg_line="0 3 999999")
    lines = len((folder / "kg_final.txt").read_text().splitlines())
    with pytest.raises(KD.DataError) as err:
        KD.load(folder)
    message = str(err.value)
    assert message.startswith(f"{folder / 'kg_final.txt'}:{lines}: entity id 999,999 makes the entity table "
                              f"1,000,000 rows, of which ")
    assert "data.remap_ids=true" in message
    assert KD.load(kgat_folder).n_entities == convert.PRESETS["tiny"]["entities"]     # the fixture itself passes
    t0 = time.monotonic()                                  # through the CLI: exit 2 before any model is built
    out = cli("train", "--recipe", "kgat", "--epochs", "1", f"data.path={folder}", "data.cache=off",
                  "--run-dir", str(tmp_path / "run"), check=False)
    assert out.returncode == 2 and "entity id 999,999 makes the entity table" in out.stderr
    assert not list((tmp_path / "run").rglob("*.pt"))
    record_fault("a stray KGAT entity id 999999 (no list files)", steps_lost=0, exit_s=round(time.monotonic() - t0, 2),
                 outcome="exit 2 naming kg_final.txt:line, the id and the rows used; data.remap_ids=true compacts "
                         "(was: a 1M-entity table, 8.9 GB)")


def test_a_stray_item_id_is_refused_naming_the_user_line(kgat_folder, tmp_path):
    users = len((kgat_folder / "train.txt").read_text().splitlines())
    folder = sparse_copy(kgat_folder, tmp_path, train_line=f"{users} 5 999999")
    with pytest.raises(KD.DataError, match=rf"train.txt:{users + 1}: item id 999,999 makes the item table"):
        KD.load(folder)


def test_remap_ids_compacts_and_the_maps_travel_with_the_checkpoint(kgat_folder, tmp_path):
    folder = sparse_copy(kgat_folder, tmp_path, kg_line="0 3 999999")
    data = KD.load(folder, remap_ids=True)
    assert data.n_entities == convert.PRESETS["tiny"]["entities"] + 1 and data.id_maps["entity"][-1] == 999999
    assert data.kg.max() == data.n_entities - 1
    run = tmp_path / "run"
    cli("train", "--recipe", "kgat", "--epochs", "1", f"data.path={folder}", "data.remap_ids=true",
            "data.cache=off", "--batch-size", "256", "log.tensorboard=false", "--run-dir", str(run))
    saved = np.load(run / "ids.npz")
    assert np.array_equal(saved["entity"], data.id_maps["entity"])
    ckpt = torch.load(run / "checkpoints" / "final.pt", weights_only=True)
    assert torch.equal(ckpt["id_maps"]["entity"], torch.from_numpy(data.id_maps["entity"]))
    copy = tmp_path / "copied.pt"
    shutil.copy(run / "checkpoints" / "final.pt", copy)
    out = cli("eval", "--checkpoint", str(copy), "--splits", "test")
    assert "recall@20" in out.stdout
    other = sparse_copy(kgat_folder, tmp_path / "other", kg_line="0 3 888888")
    out = cli("eval", "--checkpoint", str(copy), f"data.path={other}", check=False)
    assert out.returncode == 2 and "its id maps (data.remap_ids) differ from this data's for entity" in out.stderr


def test_a_sparse_class_index_in_an_array_file_is_refused(tmp_path):
    x = np.zeros((4, 2, 8), np.float32)
    np.savez(tmp_path / "train.npz", samples=x, labels=np.array([0, 1, 999, 1]))
    with pytest.raises(HD.DataError, match=r"train.npz: field 'labels'\[2\]: class id 999 makes the class table "
                                           r"1,000 rows, of which 3"):
        HD.read_arrays(tmp_path / "train.npz")
    np.savez(tmp_path / "ok.npz", samples=x, labels=np.array([0, 1, 2, 1]))
    assert len(HD.read_arrays(tmp_path / "ok.npz").class_names) == 3


def test_the_rule_is_documented_with_its_figures():
    from tests.conftest import REPO
    page = (REPO / "docs" / "checkpoints-and-faults.md").read_text()
    assert "data.remap_ids" in page and f"{TABLE_FLOOR:,}" in page and f"{MAX_UNUSED:.0%}" in page

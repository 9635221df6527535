"""Atomic writes, weights-only loading, truncated/foreign checkpoints, RNG capture, keep-last-k."""
import random

import numpy as np
import pytest
import torch

from trainer.engine import ckpt_io as ck
from trainer.engine.state import TrainState, where


def _ckpt(step, recipe="toy", model=None):
    model = model or torch.nn.Linear(3, 2)
    return dict(format=ck.FORMAT_VERSION, recipe=recipe, kind="periodic", model=model.state_dict(), optimizer={},
                scheduler={}, scaler={}, state={}, world_size=1, global_step=step, rng=[ck.capture_rng()],
                config={"recipe": recipe}, versions=ck.versions())


def test_an_unversioned_checkpoint_is_format_1_and_loads(tmp_path):
    old = {k: v for k, v in _ckpt(4).items() if k != "format"}      # written before the field existed
    ck.atomic_save(old, tmp_path / "old.pt")
    assert ck.load(tmp_path / "old.pt")["global_step"] == 4


def test_a_newer_format_is_refused_with_both_numbers_and_left_in_place(tmp_path):
    m = ck.CheckpointFolder(tmp_path, keep_last=5)
    m.save(_ckpt(2), "periodic")
    m.save(dict(_ckpt(4), format=ck.FORMAT_VERSION + 1), "periodic")
    with pytest.raises(ck.NewerCheckpointError, match=f"format {ck.FORMAT_VERSION + 1}; this trainer reads "
                                                       f"formats 1 to {ck.FORMAT_VERSION}"):
        m.newest_valid()
    assert m.periodic_path(4).exists() and not list(tmp_path.glob("checkpoints/*.corrupt"))


def test_a_checkpoint_missing_keys_of_its_format_is_set_aside_and_the_previous_one_resumed(tmp_path, caplog):
    m = ck.CheckpointFolder(tmp_path, keep_last=5)
    m.save(_ckpt(2), "periodic")
    m.save({k: v for k, v in _ckpt(4).items() if k != "world_size"}, "periodic")
    path, state = m.newest_valid()
    assert path == m.periodic_path(2) and state["global_step"] == 2
    assert f"lacks 'world_size' of checkpoint format {ck.FORMAT_VERSION}" in caplog.text
    assert (tmp_path / "checkpoints" / "step-00000004.pt.corrupt").exists()


def test_atomic_save_and_weights_only_load(tmp_path):
    m = ck.CheckpointFolder(tmp_path)
    path = m.save(_ckpt(5), "periodic")
    assert path.name == "step-00000005.pt"
    assert not list(path.parent.glob(".*tmp*"))             # no temporary left behind
    loaded = ck.load(path)
    assert loaded["global_step"] == 5 and isinstance(loaded["rng"][0]["torch"], torch.Tensor)


def test_newest_valid_skips_truncated(tmp_path, caplog):
    m = ck.CheckpointFolder(tmp_path, keep_last=5)
    for step in (2, 4, 6):
        m.save(_ckpt(step), "periodic")
    newest = m.periodic_path(6)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])   # truncated, e.g. node died
    path, state = m.newest_valid()
    assert path == m.periodic_path(4) and state["global_step"] == 4
    assert "skipping" in caplog.text and "truncated, corrupt" in caplog.text


def test_final_preferred_and_garbage_refused(tmp_path):
    m = ck.CheckpointFolder(tmp_path)
    m.save(_ckpt(3), "periodic")
    m.save(_ckpt(9), "final")
    assert m.newest_valid()[0].name == "final.pt"
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(ck.CheckpointError, match="junk.pt is truncated, corrupt or unsafe"):
        ck.load(tmp_path / "junk.pt")
    torch.save({"weights": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(ck.CheckpointError, match="not a trainer checkpoint"):
        ck.load(tmp_path / "other.pt")


def test_unsafe_pickle_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))
    torch.save(dict(recipe="toy", model={}, payload=Evil()), tmp_path / "evil.pt")
    with pytest.raises(ck.CheckpointError):
        ck.load(tmp_path / "evil.pt")


def test_foreign_recipe_and_shape_mismatch_refused():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ck.CheckpointError, match="written by recipe 'kgat'; this run is 'toy'"):
        ck.check_compatible(_ckpt(1, "kgat", model), "toy", model, "x.pt")
    with pytest.raises(ck.CheckpointError, match=r"weight: checkpoint \(2, 4\) vs model \(2, 3\)"):
        ck.check_compatible(_ckpt(1, "toy", torch.nn.Linear(4, 2)), "toy", model, "x.pt")
    ck.check_compatible(_ckpt(1, "toy", model), "toy", model, "x.pt")


def test_keep_last_prunes_periodic_only(tmp_path):
    m = ck.CheckpointFolder(tmp_path, keep_last=2)
    m.save(_ckpt(1), "best")
    for step in range(1, 6):
        m.save(_ckpt(step), "periodic")
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["best.pt", "step-00000004.pt", "step-00000005.pt"]


def test_rng_round_trip_through_a_file(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = ck.capture_rng()
    ck.atomic_save(dict(rng=state), tmp_path / "r.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    ck.restore_rng(torch.load(tmp_path / "r.pt", weights_only=True)["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_a_checkpoint_names_where_it_stands_as_the_evaluation_lines_do():
    assert where(TrainState(epoch=16, batch_in_epoch=0, global_step=112)) == "after epoch 15"
    assert where(TrainState(epoch=2, batch_in_epoch=3, global_step=19)) == "epoch 2, batch 3"
    assert where(TrainState()) == "epoch 0, batch 0"                 # nothing trained yet

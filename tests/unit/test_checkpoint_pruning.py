"""Pruning next to stale checkpoints, corrupt files set aside, superseded histories, temporaries."""
import logging

import torch

from trainer.engine import ckpt_io as ck


def _ckpt(step):
    return dict(recipe="toy", kind="periodic", model=torch.nn.Linear(3, 2).state_dict(), optimizer={}, scheduler={},
                scaler={}, state={}, world_size=1, global_step=step, rng=[], config={})


def _names(m):
    return sorted(p.name for p in m.dir.iterdir())


def test_pruning_keeps_the_new_checkpoint_next_to_higher_numbered_stale_ones(tmp_path):
    """Seen on main: stale step-800/900 made every new periodic checkpoint vanish right after its write."""
    m = ck.CheckpointFolder(tmp_path, keep_last=2)
    for step in (800, 900):
        m.save(_ckpt(step), "periodic")
    m.save(_ckpt(8), "periodic")
    assert m.periodic_path(8).exists()
    m.save(_ckpt(16), "periodic")
    m.save(_ckpt(24), "periodic")
    assert _names(m) == ["step-00000016.pt", "step-00000024.pt", "step-00000800.pt", "step-00000900.pt"]


def test_keep_last_zero_keeps_every_periodic_checkpoint(tmp_path):
    m = ck.CheckpointFolder(tmp_path, keep_last=0)
    for step in range(1, 6):
        m.save(_ckpt(step), "periodic")
    assert len(m.periodic()) == 5


def test_unloadable_checkpoints_are_moved_aside_not_deleted(tmp_path, caplog):
    m = ck.CheckpointFolder(tmp_path, keep_last=3)
    m.save(_ckpt(4), "periodic")
    for step in (800, 900):
        m.periodic_path(step).write_bytes(b"garbage" * 10)
    with caplog.at_level(logging.WARNING):
        path, state = m.newest_valid()
    assert path == m.periodic_path(4) and state["global_step"] == 4
    assert _names(m) == ["step-00000004.pt", "step-00000800.pt.corrupt", "step-00000900.pt.corrupt"]
    assert (m.dir / "step-00000900.pt.corrupt").read_bytes() == b"garbage" * 10   # kept as it was
    assert "moved aside as step-00000900.pt.corrupt" in caplog.text
    m.periodic_path(900).write_bytes(b"again")            # a second corrupt file of the same name
    m.newest_valid()
    assert (m.dir / "step-00000900.pt.corrupt.1").read_bytes() == b"again"


def test_checkpoints_of_a_later_step_are_set_aside_after_resuming_an_earlier_one(tmp_path):
    m = ck.CheckpointFolder(tmp_path, keep_last=5)
    for step in (8, 16, 24):
        m.save(_ckpt(step), "periodic")
    m.save(_ckpt(24), "final")
    moved = m.set_aside_newer(8, m.periodic_path(8))
    assert sorted(p.name for p in moved) == ["final.pt.superseded", "step-00000016.pt.superseded",
                                             "step-00000024.pt.superseded"]
    assert [p.name for p in m.candidates()] == ["step-00000008.pt"]


def test_another_recipes_checkpoint_is_named_as_such_not_as_a_later_step(tmp_path, caplog):
    """Issue 57: a checkpoint of another recipe met after a resume is named by its recipe and set aside."""
    m = ck.CheckpointFolder(tmp_path, keep_last=5)
    m.save(_ckpt(8), "periodic")
    m.save(dict(_ckpt(4), recipe="kgat"), "final")            # older, of another recipe
    with caplog.at_level(logging.WARNING):
        moved = m.set_aside_newer(8, m.periodic_path(8), recipe=_ckpt(8)["recipe"])
    assert [p.name for p in moved] == ["final.pt.other-recipe"]
    assert "is a checkpoint of recipe 'kgat', not of this run's" in caplog.text and "later step" not in caplog.text


def test_interrupted_save_temporaries_are_removed(tmp_path):
    m = ck.CheckpointFolder(tmp_path)
    m.save(_ckpt(1), "periodic")
    tmp = m.dir / ".step-00000002.pt.tmp.4242"
    tmp.write_bytes(b"half")
    other = m.dir / "notes.tmp.txt"
    other.write_text("user file")
    assert m.remove_temporaries() == [tmp]
    assert not tmp.exists() and other.exists() and m.periodic_path(1).exists()


def test_fresh_run_into_a_directory_with_checkpoints_is_refused(tmp_path):
    ck.refuse_fresh_run(tmp_path)                       # nothing there: fine
    ck.CheckpointFolder(tmp_path).save(_ckpt(3), "best")
    try:
        ck.refuse_fresh_run(tmp_path)
    except ck.CheckpointError as err:
        assert "already holds checkpoints (best.pt)" in str(err)
        assert "--resume auto" in str(err) and "--run-dir" in str(err)
    else:
        raise AssertionError("a fresh run was allowed into a run directory with checkpoints")

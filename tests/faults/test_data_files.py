"""Truncated or garbage data files: a clear error naming the file (no traceback), or, for the frame cache
that the trainer owns, a rebuild of the damaged entry."""
import shutil
import time

import numpy as np
import pytest

from tests.conftest import record_fault
from tests.inprocess import cli
from trainer.recipes.video import data as D


def _arrays(folder, n=12):
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        np.savez(folder / f"{split}.npz", samples=rng.normal(size=(n, 2, 16)).astype(np.float32),
                 labels=np.arange(n) % 3)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_damaged_npz_data_file_is_an_error_naming_it(tmp_path, damage):
    _arrays(tmp_path)
    path = tmp_path / "train.npz"
    blob = path.read_bytes()
    path.write_bytes({"truncated": blob[: len(blob) // 2], "garbage": b"\x89junk" * 100, "empty": b""}[damage])
    t0 = time.monotonic()
    proc = cli("train", "--recipe", "har", "--epochs", "1", f"data.path={tmp_path}", "--run-dir",
                   str(tmp_path / "run"), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"{path}: cannot be read as a .npz file" in proc.stderr
    record_fault(f"{damage} .npz data file (har)", exit_s=round(time.monotonic() - t0, 2), steps_lost=0,
                 outcome="exit 2 naming the file")


@pytest.mark.parametrize("damage", ["truncated", "missing field"])
def test_a_damaged_kgat_pretrain_file_is_an_error_naming_it(tmp_path, damage):
    mf = tmp_path / "mf.npz"
    if damage == "truncated":
        np.savez(mf, user_embed=np.zeros((300, 8), np.float32), item_embed=np.zeros((200, 8), np.float32))
        mf.write_bytes(mf.read_bytes()[:300])
        expected = f"{mf}: cannot be read as a .npz file"
    else:
        np.savez(mf, user_embed=np.zeros((300, 8), np.float32))
        expected = f"{mf}: field 'item_embed' missing"
    proc = cli("train", "--recipe", "kgat", "--epochs", "1", f"model.pretrain={mf}", "model.width=8",
                   "--run-dir", str(tmp_path / "run"), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert expected in proc.stderr


def test_a_truncated_frame_cache_entry_is_rebuilt(tmp_path):
    src = D.synth_videos(tmp_path / "videos", videos=2, frames=20, size=32, classes=2)
    videos, spec, cache = D.find_videos(src), D.CacheSpec(size=16, gray=True), src / ".frame-cache"
    manifest = D.extract_frames(videos, cache, spec, progress=False)
    npy = cache / manifest["synth01.mp4"]["file"]
    good = npy.read_bytes()
    npy.write_bytes(good[: len(good) // 2])                       # a node died while copying the cache
    assert D.stale_reason(manifest["synth01.mp4"], videos["synth01.mp4"], cache, spec) == \
        "cache file truncated or corrupt"
    D.extract_frames(videos, cache, spec, progress=False)
    assert npy.read_bytes() == good
    shutil.copy(npy, cache / "copy.npy")
    assert D.cached_shape(cache / "copy.npy") == (20, 16, 16)

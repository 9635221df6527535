"""Issue 57 item 4, issue 68 point 4: a refusal writes nothing. Every check that can refuse a resume or a start
(settings, recipe, checkpoint format, data, weights' shapes, memory) runs before any file of the run directory is
written, renamed or removed: on a run directory that also holds a damaged final.pt and a stale temporary of an
interrupted save, the directory's bytes (its lock file included: issue 82 point 4) are the same before and after each
refusal, and the data cache keeps every entry it had (a refusal that parsed other data may add one); a refused
fresh start leaves no run directory behind (it removes the lock and the folders it made)."""
from __future__ import annotations

import shutil

import pytest
import torch

from tests.faults.conftest import ARGS, write_udata
from tests.inprocess import cli
from trainer.data import owners
from trainer.recipes.sasrec import data as SD
from trainer.recipes.sasrec.config import SeqDataConfig


def contents(run_dir):
    """Every file's bytes (and every folder) under run_dir, the lock's included."""
    return {str(p.relative_to(run_dir)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(run_dir.rglob("*"))}


def other_rows(data):
    write_udata(data / "u.data", per_user=20)                   # fewer rows, every user and item kept


def other_items(data):
    write_udata(data / "u.data", items=70)


def future_format(run):
    path = run / "checkpoints" / RESUMED
    ckpt = torch.load(path, weights_only=True)
    ckpt["format"] = 99
    torch.save(ckpt, path)


RESUMED = "step-00000002.pt"       # final.pt's copy: --resume auto takes it, final.pt being damaged


def damage(run):
    """final.pt truncated, its content kept as the newest periodic checkpoint, and a killed save's temporary."""
    ckpts = run / "checkpoints"
    final = (ckpts / "final.pt").read_bytes()
    (ckpts / RESUMED).write_bytes(final)
    (ckpts / "final.pt").write_bytes(final[: len(final) // 2])
    (ckpts / f".{RESUMED}.tmp.4242").write_bytes(b"half a save")


def cache_entries(cache):
    return {p.name: p.stat().st_ino for p in cache.iterdir() if not p.name.startswith(".")}


CASES = {   # name: (what to change before the resume (on data or run), the resume's extra words, the refusal)
    "a setting that cannot change": (None, ["model.width=24"], "cannot change on resume"),
    "another recipe": (None, ["--recipe", "har"], "was written by recipe 'sasrec'"),    # (its flags replace)
    "a checkpoint format": ("run", future_format, "format"),
    "other data": ("data", other_rows, "the data differs from the data it trained on"),
    "other shapes": ("data", other_items, "does not fit this model"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_resume_leaves_the_run_directory_as_it_was(trained, tmp_path, case):
    where, change, said = CASES[case]
    shutil.copytree(trained / "run", tmp_path / "run")
    shutil.copytree(trained / "data", tmp_path / "data")
    damage(tmp_path / "run")
    cache = tmp_path / "cache"
    SD.load(SeqDataConfig(path=str(trained / "data"), cache=str(cache), maxlen=20))   # an entry of the cache
    owners._LEASES.release_all()                               # ... that no job maps now
    cached = cache_entries(cache)
    extra = []
    if where == "data":
        change(tmp_path / "data")
        extra = ["--allow-data-change"] if case == "other shapes" else []
    elif where == "run":
        change(tmp_path / "run")
    else:
        extra = change
    before = contents(tmp_path / "run")
    base = ARGS if case != "another recipe" else ("log.tensorboard=false",)
    args = [*base, *(extra if where is None else []), f"data.path={tmp_path / 'data'}", "--epochs", "2",
            f"data.cache={cache}", "data.cache_cap_gb=0.000001",
            "--run-dir", str(tmp_path / "run"), "--resume", "auto", *(extra if where == "data" else [])]
    proc = cli("train", *args, check=False)
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr[-2000:]
    after = contents(tmp_path / "run")
    assert after == before, sorted(set(after.items()) ^ set(before.items()), key=str)[:6]
    now = cache_entries(cache)
    assert {k: now.get(k) for k in cached} == cached           # every entry kept, none renamed (at a cap of ~0)


def test_a_refused_start_leaves_nothing(tmp_path):
    proc = cli("train", *ARGS, "model.width=65536", "--epochs", "1", "--run-dir", str(tmp_path / "runs" / "run"),
                   check=False)
    assert proc.returncode == 4 and "the model needs" in proc.stderr
    assert list(tmp_path.iterdir()) == []                   # the lock and the folders it made, removed


def test_a_resume_that_passes_writes_the_log_from_the_start(trained, tmp_path):
    shutil.copytree(trained / "run", tmp_path / "run")
    cli("train", *ARGS, f"data.path={trained / 'data'}", "--epochs", "2", "--run-dir", str(tmp_path / "run"),
            "--resume", "auto")
    log = (tmp_path / "run" / "train.log").read_text()
    # the lines logged before the run directory could be written (the data, the model's estimate) are in it
    second = log[log.rindex("sequences: "):]
    assert "model: " in second and "resumed from" in second
    assert len(list((tmp_path / "run").glob("config.*.yaml"))) == 1     # epochs 1 -> 2: the old one kept
    assert (tmp_path / "run" / "exits" / "rank-0.json").exists()


def test_a_resume_that_passes_then_sets_the_damage_aside(trained, tmp_path):
    shutil.copytree(trained / "run", tmp_path / "run")
    damage(tmp_path / "run")
    proc = cli("train", *ARGS, f"data.path={trained / 'data'}", "--epochs", "2", "--run-dir",
                   str(tmp_path / "run"), "--resume", "auto")
    ckpts = tmp_path / "run" / "checkpoints"
    assert f"resumed from {ckpts / RESUMED}" in proc.stderr
    assert (ckpts / "final.pt.corrupt").exists() and not (ckpts / f".{RESUMED}.tmp.4242").exists()


def test_a_checkpoint_of_another_torch_resumes_with_the_difference_logged(trained, tmp_path):
    shutil.copytree(trained / "run", tmp_path / "run")
    path = tmp_path / "run" / "checkpoints" / "final.pt"
    ckpt = torch.load(path, weights_only=True)
    ckpt["versions"] = dict(ckpt["versions"], torch="2.11.0")
    torch.save(ckpt, path)
    proc = cli("train", *ARGS, f"data.path={trained / 'data'}", "--epochs", "2", "--run-dir",
                   str(tmp_path / "run"), "--resume", "auto")
    assert f"versions changed on resume: torch 2.11.0 -> {torch.__version__}" in proc.stderr
    from trainer.engine.logging import read_metrics
    assert any("torch 2.11.0" in str(r) for r in read_metrics(tmp_path / "run", "resume"))

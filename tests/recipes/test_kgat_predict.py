"""Issue 72, KGAT: `trainer predict` on sparse user ids (data.remap_ids=true): the file's own ids out, every item the
user has in train.txt or test.txt left out, the same order as the unmasked full ranking (--keep-seen) with those
items taken away; users the checkpoint never saw skipped or given the popular items, as asked."""
from __future__ import annotations

import csv
import shutil

import pytest

from tests.inprocess import cli
from trainer.recipes.kgat import convert

pytestmark = pytest.mark.long      # several launches of the trainer: make test-fast leaves it out


def sparse_users(folder, out):
    """A copy whose user ids are 10 u + 7 (train.txt and test.txt)."""
    shutil.copytree(folder, out)
    seen: dict[str, set[str]] = {}
    for name in ("train.txt", "test.txt"):
        lines = []
        for line in (out / name).read_text().splitlines():
            user, *items = line.split()
            sparse = str(10 * int(user) + 7)
            seen.setdefault(sparse, set()).update(items)
            lines.append(" ".join([sparse, *items]))
        (out / name).write_text("\n".join(lines) + "\n")
    return out, seen


def read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_kgat_top_k_in_the_files_ids_without_seen_items(tmp_path):
    tiny = convert.write(convert.synthesize(convert.Stats(**convert.PRESETS["tiny"]), seed=0), tmp_path / "tiny")
    folder, seen = sparse_users(tiny, tmp_path / "sparse")
    run = tmp_path / "run"
    cli("train", "--recipe", "kgat", "--epochs", "1", f"data.path={folder}", "data.remap_ids=true",
            "data.cache=off", "--batch-size", "256", "log.tensorboard=false", "--run-dir", str(run))
    cli("predict", "--checkpoint", str(run), "--out", str(tmp_path / "top.csv"), "--top-k", "5",
            "--part-size", "64")
    cli("predict", "--checkpoint", str(run), "--out", str(tmp_path / "all.csv"), "--top-k", "100000",
            "--keep-seen")
    top, everything = read(tmp_path / "top.csv"), read(tmp_path / "all.csv")
    by_user: dict[str, list] = {}
    for r in top:
        by_user.setdefault(r["user"], []).append(r)
    assert set(by_user) == set(seen)                                       # the sparse ids, every user
    full: dict[str, list] = {}
    for r in everything:
        full.setdefault(r["user"], []).append(r["item"])
    for user, ranked in by_user.items():
        assert [int(r["rank"]) for r in ranked] == [1, 2, 3, 4, 5]
        assert not {r["item"] for r in ranked} & seen[user]
        assert [r["item"] for r in ranked] == [i for i in full[user] if i not in seen[user]][:5]
    # listed users: one the checkpoint never saw
    users = tmp_path / "users.txt"
    users.write_text("17\n99999\n")
    skip = cli("predict", "--checkpoint", str(run), "--out", str(tmp_path / "skip.csv"), "--users", str(users))
    assert "1 of 2 users the checkpoint never saw: skipped (99999)" in skip.stderr
    assert {r["user"] for r in read(tmp_path / "skip.csv")} == {"17"}
    cli("predict", "--checkpoint", str(run), "--out", str(tmp_path / "pop.csv"), "--users", str(users),
            "--unknown-users", "popular", "--top-k", "3")
    cold = [r for r in read(tmp_path / "pop.csv") if r["user"] == "99999"]
    counts = [float(r["score"]) for r in cold]
    assert len(cold) == 3 and counts == sorted(counts, reverse=True) and counts[0] >= 1
    refused = cli("predict", "--checkpoint", str(run), "--out", str(tmp_path / "x.csv"), "--data", str(folder),
                      check=False)
    assert refused.returncode == 2 and "kgat: --data does not apply" in refused.stderr

"""Issue 72 (`python -m trainer predict`), SASRec: each user's top-K items in the file's own ids (sparse user and
item ids here, not the internal codes), seen items left out, the same rows as the model's full ranking computed
directly; 1, 2 and 4 ranks write the same file; a requeued predict computes only the parts it lacks; a new file's
unknown items are dropped and counted; refusals in one line."""
from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import run_ranks
from tests.inprocess import cli
from tests.timeouts import limit
from trainer.config.settings import from_dict
from trainer.recipes.sasrec.model import SeqRec
from trainer.recipes.sasrec.sequences import synthesize, write_udata

# several launches of the trainer each (a minute together): in the cluster half, beside its waits on the scheduler
pytestmark = pytest.mark.long

USERS, ITEMS = 90, 70


def raw_ids(inter):
    """Sparse ids: users 5000, 5003, ...; items 100, 107, ..."""
    inter.user_ids = 5000 + 3 * np.asarray(inter.user_ids, dtype=np.int64)
    inter.item_ids = 100 + 7 * np.asarray(inter.item_ids, dtype=np.int64)
    return inter


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("predict")
    inter = raw_ids(synthesize(USERS, ITEMS, 12, seed=0))
    data = write_udata(inter, root / "u.data")
    cli("train", "--recipe", "sasrec", f"data.path={data}", f"data.cache={root / 'cache'}", "--epochs", "2",
            "log.tensorboard=false", "model.mhc=false", "model.time=false", "data.maxlen=20",
            "--run-dir", str(root / "run"))
    return root, inter


def predict(root: Path, out: str, *extra: str, check: bool = True):
    return cli("predict", "--checkpoint", str(root / "run"), "--out", str(root / out), *extra, check=check)


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def history_of(inter) -> dict[int, set[int]]:
    seen: dict[int, set[int]] = {}
    for u, i in zip(inter.user_ids.tolist(), inter.item_ids.tolist()):
        seen.setdefault(u, set()).add(i)
    return seen


def test_top_k_in_the_files_ids_are_the_full_rankings_own(trained):
    root, inter = trained
    proc = predict(root, "one.csv", "--top-k", "5", "--part-size", "40")
    assert "predicting sasrec for 90 users" in proc.stderr and "3 parts of 40, 0 already written" in proc.stderr
    rows = read_rows(root / "one.csv")
    seen = history_of(inter)
    by_user: dict[int, list] = {}
    for r in rows:
        by_user.setdefault(int(r["user"]), []).append((int(r["rank"]), int(r["item"]), float(r["score"])))
    assert set(by_user) == set(seen) and all(len(v) == 5 for v in by_user.values())
    for u, ranked in by_user.items():
        assert [r for r, _, _ in ranked] == [1, 2, 3, 4, 5]
        assert not {i for _, i, _ in ranked} & seen[u], "a seen item was recommended"
        scores = [s for _, _, s in ranked]
        assert scores == sorted(scores, reverse=True)
    # the model itself, on the whole history of three users: the same items and scores
    ckpt = torch.load(root / "run" / "checkpoints" / "best.pt", weights_only=True)
    cfg = from_dict(ckpt["config"])
    items = np.unique(inter.item_ids)                              # code order: sorted numerically
    model = SeqRec(cfg.model, len(items), cfg.data.maxlen)
    model.load_state_dict(ckpt["model"])
    model.eval()
    order = np.lexsort((np.asarray(inter.times), inter.user_ids))
    for u in sorted(seen)[:3]:
        mine = order[inter.user_ids[order] == u]
        codes = np.searchsorted(items, inter.item_ids[mine]) + 1
        seq = torch.zeros(1, cfg.data.maxlen, dtype=torch.int64)
        tail = torch.from_numpy(codes[-cfg.data.maxlen:])
        seq[0, -len(tail):] = tail
        with torch.no_grad():
            scores = model.score(seq, torch.zeros_like(seq))[0, 1:]
        scores[codes - 1] = float("-inf")
        best = torch.sort(scores, descending=True, stable=True)
        assert [i for _, i, _ in by_user[u]] == items[best.indices[:5].numpy()].tolist()
        assert np.allclose([s for _, _, s in by_user[u]], best.values[:5].numpy(), atol=1e-5)


def test_two_and_four_ranks_write_the_one_process_file(trained):
    root, _ = trained
    if not (root / "one.csv").exists():
        predict(root, "one.csv", "--top-k", "5", "--part-size", "40")
    one = read_rows(root / "one.csv")
    for n in (2, 4):
        run_ranks(n, "predict", "--checkpoint", str(root / "run"), "--out", str(root / f"ranks{n}.csv"), "--top-k",
                  "5", "--part-size", "7")
        many = read_rows(root / f"ranks{n}.csv")
        assert [(r["user"], r["rank"], r["item"]) for r in many] == [(r["user"], r["rank"], r["item"]) for r in one]
        assert np.allclose([float(r["score"]) for r in many], [float(r["score"]) for r in one], atol=1e-5)
        assert not (root / f"ranks{n}.csv.parts").exists()


def test_a_requeued_predict_writes_only_the_parts_it_lacks(trained):
    root, _ = trained
    predict(root, "resume.csv", "--top-k", "3", "--part-size", "20", "--parts")
    folder = root / "resume.csv.parts"
    parts = sorted(folder.glob("part-*.csv"))
    assert len(parts) == 5 and (folder / "manifest.json").exists() and not (root / "resume.csv").exists()
    whole = {p.name: p.read_bytes() for p in parts}
    parts[1].unlink(), parts[3].unlink()                            # as a preemption would leave it
    kept = {p.name: os.stat(p).st_mtime_ns for p in parts if p.exists()}
    proc = predict(root, "resume.csv", "--top-k", "3", "--part-size", "20", "--parts")
    assert "3 already written" in proc.stderr and "(continuing)" in proc.stderr
    assert {p.name: p.read_bytes() for p in sorted(folder.glob("part-*.csv"))} == whole
    assert {name: os.stat(folder / name).st_mtime_ns for name in kept} == kept, "a written part was written again"
    proc = predict(root, "resume.csv", "--top-k", "3", "--part-size", "20")     # joins: nothing left to compute
    assert "5 already written" in proc.stderr and not folder.exists()
    rows = (root / "resume.csv").read_text().splitlines()
    assert rows[0] == "user,rank,item,score" and len(rows) == 1 + USERS * 3
    assert rows[1:] == [line for name in sorted(whole) for line in whole[name].decode().splitlines()[1:]]
    stale = predict(root, "resume.csv", "--top-k", "4", check=False)
    assert stale.returncode != 0 and "exists: pass --overwrite" in stale.stderr


def test_users_list_new_data_and_refusals(trained, tmp_path):
    root, inter = trained
    (tmp_path / "users.txt").write_text("5006\n5003\n")
    predict(root, "two.csv", "--top-k", "2", "--users", str(tmp_path / "users.txt"))
    rows = read_rows(root / "two.csv")
    assert [r["user"] for r in rows] == ["5006", "5006", "5003", "5003"]
    (tmp_path / "bad.txt").write_text("5003\n77\n")
    bad = predict(root, "bad.csv", "--users", str(tmp_path / "bad.txt"), check=False)
    assert bad.returncode != 0 and "1 of 2 users have no history in the data (77)" in bad.stderr
    # a new user, and an item the checkpoint never saw
    new = tmp_path / "new.data"
    new.write_text("9999\t107\t5\t1\n9999\t114\t5\t2\n9999\t99999\t5\t3\n")
    proc = predict(root, "new.csv", "--top-k", "3", "--data", str(new))
    assert "1 of 3 interactions are of 1 items the checkpoint does not know: dropped" in proc.stderr
    rows = read_rows(root / "new.csv")
    assert [r["user"] for r in rows] == ["9999"] * 3 and not {r["item"] for r in rows} & {"107", "114"}
    (tmp_path / "har.ts").write_text("@problemName x\n@classLabel false\n@data\n1,2,3:4,5,6\n")   # another recipe's
    for args, message in [(("--out", str(tmp_path / "x.txt")), "unknown suffix '.txt'"),
                          (("--checkpoint", str(tmp_path / "none")), "none"),
                          (("--data", str(tmp_path / "har.ts")), "har.ts")]:
        proc = cli("predict", "--checkpoint", str(root / "run"), "--out", str(tmp_path / "y.csv"), *args,
                       check=False)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 2 and last.startswith("error: ") and message in last, proc.stderr
        assert "Traceback" not in proc.stderr


def test_parquet_output(trained):
    pq = pytest.importorskip("pyarrow.parquet", reason="the parquet extra (pyarrow) is not installed")
    root, _ = trained
    predict(root, "top.parquet", "--top-k", "4", "--part-size", "50")
    table = pq.read_table(root / "top.parquet")
    assert table.column_names == ["user", "rank", "item", "score"] and table.num_rows == USERS * 4
    assert table.column("item").type.bit_width == 64 and str(table.column("score").type) == "float"


def test_submitit_runs_the_predict_in_two_tasks(trained, tmp_path):
    """hpc/submit.py predict: checked before anything is submitted, then two local submitit tasks (the tasks and
    the environment of a Slurm job, without Slurm: the cluster test is tests/slurm/test_sbatch.py's) write the one
    process's rows."""
    import subprocess
    import sys

    from tests.conftest import REPO, clean_env
    root, _ = trained
    if not (root / "one.csv").exists():
        predict(root, "one.csv", "--top-k", "5", "--part-size", "40")
    submit = [sys.executable, str(REPO / "hpc" / "submit.py"), "predict", "--checkpoint", str(root / "run")]
    refused = subprocess.run([*submit, "--out", str(root / "one.csv"), "--dry-run"], env=clean_env(), text=True,
                             capture_output=True, cwd=tmp_path)
    assert refused.returncode == 2 and "one.csv exists: pass --overwrite" in refused.stderr
    done = subprocess.run([*submit, "--out", str(root / "submitit.csv"), "--top-k", "5", "--part-size", "40",
                           "--cluster", "local", "--tasks-per-node", "2", "--follow", "--folder", str(tmp_path / "s")],
                          env=clean_env(), text=True, capture_output=True, cwd=tmp_path, timeout=limit("long"))
    assert done.returncode == 0 and "FINISHED" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    assert (root / "submitit.csv").read_text() == (root / "one.csv").read_text()
    assert (tmp_path / "s").stat().st_mode & 0o077 == 0            # the submitit folder is private

"""slurm/*.sbatch: pinned headers, and real jobs on the local cluster (completion, preemption, USR1, IMAGE)."""
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import PY, REPO, slurm_env
from tests.inprocess import cli
from tests.slurm.test_cluster import wait_job
from tests.timeouts import limit
from trainer.engine.logging import read_metrics
from trainer.recipes.kgat.config import KGATDataConfig
from trainer.recipes.kgat.recipe import load_data

SCRIPTS = sorted((REPO / "slurm").glob("*.sbatch"))
GOLDEN = REPO / "tests" / "golden" / "sbatch"


def sbatch_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith("#SBATCH")]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_sbatch_header_matches_golden_file(script):
    lines = sbatch_lines(script)
    assert lines == (GOLDEN / f"{script.stem}.txt").read_text().splitlines()
    opts = dict(re.match(r"#SBATCH --([\w-]+)(?:=(\S+))?", line).groups() for line in lines)
    assert opts["ntasks-per-node"] == opts["gpus-per-node"]            # one task per GPU
    assert opts["signal"] == "B:USR1@120" and "requeue" in opts and opts["output"] == "%x-%j.out"
    text = script.read_text()
    assert 'source "${TRAINER_HOME:-$SLURM_SUBMIT_DIR}/slurm/common.sh"' in text
    if script.stem == "predict":       # no training: one step that writes parts, under the same signal forwarding
        last = text.replace("\\\n", "").rstrip().splitlines()[-3:]
        assert re.fullmatch(r'srun --kill-on-bad-exit=1 .*"\$\{LAUNCH\[@\]\}" -m trainer predict --checkpoint '
                            r'"\$CHECKPOINT" --out "\$OUT" *"\$@" "\$\{EXTRA_ARGS\[@\]\}" &', last[0]), last
        assert last[1:] == ["wait_forwarding $! || rc=$?", 'exit "$rc"']
        return
    assert script.stem.endswith(f"_{opts['nodes']}node")
    # the last line: the training step under the restart loop (which waits, forwarding signals)
    last = text.replace("\\\n", "").rstrip().splitlines()[-1]
    assert re.fullmatch(r'run_training srun --kill-on-bad-exit=1 .*"\$\{LAUNCH\[@\]\}" -m trainer train '
                        r'.*--resume auto "\$@" "\$\{EXTRA_ARGS\[@\]\}"', last), last


def test_every_golden_file_has_its_script():
    assert {p.stem for p in GOLDEN.glob("*.txt")} == {p.stem for p in SCRIPTS}


# ------------------------------------------------------------------------------------- on the cluster

def submit_script(conf, workdir: Path, script: str, *opts: str, env: dict | None = None, args=()) -> str:
    workdir.mkdir(parents=True, exist_ok=True)
    e = slurm_env(conf, PYTHON=PY, TRAINER_HOME=str(REPO), **(env or {}))
    out = subprocess.run(["sbatch", "--parsable", *opts, str(REPO / "slurm" / script), *args], cwd=workdir, env=e,
                         text=True, capture_output=True, check=True, timeout=limit("minute")).stdout
    return out.strip().split(";")[0]


def toy_config(tmp_path: Path, epochs: int, sleep: float) -> str:
    path = tmp_path / "toy.yaml"
    path.write_text(f"recipe: toy\ndata:\n  step_sleep: {sleep}\ntrain:\n  epochs: {epochs}\n"
                    "  log_every_steps: 1\nckpt:\n  every_steps: 4\n")
    return str(path)


def wait_for_log(path: Path, pattern: str, timeout: float = limit("run")) -> re.Match:
    """The pattern's first match in a job's log, within `timeout` of the log's start: the job may first wait in the
    queue behind the other cluster worker's jobs (a log still absent after 120 s in a CI run)."""
    queued = time.monotonic() + limit("long")
    while not path.exists() and time.monotonic() < queued:
        time.sleep(0.2)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = path.exists() and re.search(pattern, path.read_text())
        if found:
            return found
        time.sleep(0.2)
    tail = path.read_text()[-3000:] if path.exists() else "(no such file)"
    raise AssertionError(f"{pattern!r} not in {path} after {timeout}s; its end:\n{tail}")


def one_epoch_job(conf, workdir: Path, script: str, extra: str, timeout: float,
                  env: dict | None = None) -> tuple[str, Path, Path]:
    """Submit `script --epochs 1` with EXTRA overrides, one CPU per task; (job id, log, run dir) once it
    COMPLETED (the assertion shows the log's tail otherwise)."""
    job = submit_script(conf, workdir, script, "--cpus-per-task=1", "--time=10", env=dict(EXTRA=extra, **(env or {})),
                        args=("--epochs", "1"))
    info = wait_job(conf, job, timeout=timeout)
    log = workdir / f"{script.split('_')[0]}-{job}.out"
    run = workdir / "runs" / job
    assert info["JobState"] == "COMPLETED", log.read_text()[-3000:]
    # a relaunch (a host left out by the pre-flight, a crash) would change what the caller asserts: say why here
    extra_files = [run / name for name in ("restarts.jsonl", "preflight.json") if (run / name).exists()]
    assert "relaunching the training step" not in log.read_text(), "\n".join(
        [log.read_text()[-3000:], *(f"{p.name}: {p.read_text()[-3000:]}" for p in extra_files)])
    return job, log, run


def test_sasrec_1node_completes_with_four_ranks(slurm_cluster, tmp_path):
    data = tmp_path / "data"
    cli("data", "synth", "sasrec", "--out", str(data), "--users", "120", "--items", "60", env=slurm_env(slurm_cluster))
    extra = (f"data.path={data} data.maxlen=16 model.width=16 model.depth=1 model.heads=1 train.eval_every_epochs=1 "
             "log.per_rank=true")
    job, log, run = one_epoch_job(slurm_cluster, tmp_path, "sasrec_1node.sbatch", extra, timeout=limit("start"),
                                  env=dict(PER_TASK_LOGS="1"))
    assert "world=4" in (run / "train.log").read_text()
    # issue 19.5: one trainer log per rank and one srun output file per task
    for rank in range(4):
        assert f"[rank {rank}]" in (run / f"train.rank{rank}.log").read_text()
        assert (run / f"task-{rank}.out").exists()
    assert "[rank 1]" not in (run / "train.log").read_text()             # rank 0's log stays rank 0's
    ckpt = torch.load(run / "checkpoints" / "final.pt", weights_only=True)
    assert ckpt["world_size"] == 4 and ckpt["state"]["epoch"] == 1 and ckpt["config"]["data"]["maxlen"] == 16
    assert (run / "config.yaml").exists() and (run / "metrics.jsonl").exists()
    assert f"job {job} restart 0" in log.read_text()


def test_har_1node_completes_with_four_ranks(slurm_cluster, tmp_path):
    """DATA with a space in it reaches the trainer as one argument."""
    data = tmp_path / "my data"
    cli("data", "synth", "har", "--out", str(data), env=slurm_env(slurm_cluster))
    extra = "model.width=16 model.channel_width=16 model.head_width=32 log.tensorboard=false"
    job, log, run = one_epoch_job(slurm_cluster, tmp_path, "har_1node.sbatch", extra, timeout=limit("long"),
                                  env=dict(DATA=str(data)))
    assert "world=4" in (run / "train.log").read_text()
    ckpt = torch.load(run / "checkpoints" / "final.pt", weights_only=True)
    assert ckpt["world_size"] == 4 and ckpt["recipe"] == "har" and ckpt["config"]["data"]["path"] == str(data)
    test = read_metrics(run, "test")[-1]
    assert test["cases"] == 150 and len(test["confusion_matrix"]) == 6 and (run / "confusion_test.png").exists()


def test_video_1node_completes_with_three_ranks(slurm_cluster, tmp_path):
    """Rank 0 builds the frame cache while the others wait, then 3 ranks train (loader workers on)."""
    data = tmp_path / "videos"
    cli("data", "synth", "video", "--out", str(data), "--videos", "5", "--frames", "30", "--classes", "3",
        env=slurm_env(slurm_cluster))
    extra = ("model.arch=light data.size=32 data.clip_len=5 train.batch_size=8 log.tensorboard=false "
             "train.num_workers=1")
    job, log, run = one_epoch_job(slurm_cluster, tmp_path, "video_1node.sbatch", extra, timeout=limit("long"),
                                  env=dict(DATA=str(data), CONFIG=str(REPO / "configs/video/synthetic.yaml")))
    assert "world=3" in (run / "train.log").read_text()
    manifest = json.loads((data / ".frame-cache" / "manifest.json").read_text())
    assert sorted(manifest) == [f"synth{i:02d}.mp4" for i in range(5)] and manifest["synth00.mp4"]["frames"] == 30
    ckpt = torch.load(run / "checkpoints" / "final.pt", weights_only=True)
    assert ckpt["world_size"] == 3 and ckpt["recipe"] == "video"
    test = read_metrics(run, "test")[-1]
    assert test["cases"] == 30 and (run / "confusion_test.png").exists()


def test_a_crashing_rank_fails_the_job_at_once(slurm_cluster, tmp_path):
    """srun --kill-on-bad-exit ends the healthy ranks with TERM (rc 143) when one crashes: without the
    trainer's .preempted marker the batch shell does not hold the job as if it were being preempted."""
    data = tmp_path / "videos"
    cli("data", "synth", "video", "--out", str(data), "--videos", "3", "--frames", "20", env=slurm_env(slurm_cluster))
    job = submit_script(slurm_cluster, tmp_path, "video_1node.sbatch", "--cpus-per-task=1", "--time=10",
                        env=dict(DATA=str(data)))      # mouse.yaml's merge map does not apply to labels.csv
    info = wait_job(slurm_cluster, job, timeout=limit("run"))
    log = (tmp_path / f"video-{job}.out").read_text()
    assert info["JobState"] == "FAILED", log[-2000:]
    assert "data.merge applies to the upstream Annotations/ layout" in log and "waiting up to" not in log


def test_kgat_2node_completes_with_eight_ranks(slurm_cluster, tmp_path):
    """The product card's first command on the local 2-node cluster, with a tiny synthetic dataset."""
    data = tmp_path / "data"
    cli("data", "synth", "kgat", "--out", str(data), "--preset", "tiny", env=slurm_env(slurm_cluster))
    extra = (f"data.path={data} model.width=16 model.relation_width=16 model.layer_widths=[16,8] train.batch_size=64 "
             "train.eval_batch_size=64 log.tensorboard=false")
    job, log, run = one_epoch_job(slurm_cluster, tmp_path, "kgat_2node.sbatch", extra, timeout=limit("long"))
    train_log = (run / "train.log").read_text()
    # the seed's batch rule: each CF step draws 8 ranks x 64 users, each KG step 8 x 128 triples
    d = load_data(KGATDataConfig(path=str(data)))
    n_cf, n_kg = sum(map(len, d.train)) // (8 * 64) + 1, 2 * (sum(map(len, d.train)) + len(d.kg)) // (8 * 128) + 1
    assert "world=8" in train_log and f"CF {n_cf} + KG {n_kg} steps per epoch" in train_log
    ckpt = torch.load(run / "checkpoints" / "final.pt", weights_only=True)
    assert ckpt["world_size"] == 8 and ckpt["state"]["epoch"] == 1 and ckpt["recipe"] == "kgat"
    test = read_metrics(run, "test")[-1]
    assert test["users"] == 300 and 0 < test["recall@20"] <= 1


@pytest.mark.cluster_alone       # its high-partition job preempts every job on both nodes
def test_preempted_by_higher_priority_partition_resumes(slurm_cluster, tmp_path):
    """Slurm 22.05 sends the victim's steps SIGTERM only: the trainer checkpoints, the batch shell waits
    to be requeued, and the restart resumes from that checkpoint (nothing lost beyond it)."""
    cfg = toy_config(tmp_path, epochs=8, sleep=0.2)
    job = submit_script(slurm_cluster, tmp_path, "sasrec_1node.sbatch", "-N2", "--ntasks-per-node=2",
                        "--gpus-per-node=2", "--cpus-per-task=2", "-p", "debug",
                        env=dict(CONFIG=cfg, TRAINER_PLUGINS="tests.toy_recipe"))
    log = tmp_path / f"sasrec-{job}.out"
    wait_for_log(log, r"step 6 loss")
    high = subprocess.run(["sbatch", "--parsable", "-p", "high", "-N2", "--ntasks-per-node=4", "-o", "/dev/null",
                           "--wrap", "sleep 1"], env=slurm_env(slurm_cluster), text=True, capture_output=True,
                          check=True).stdout.strip()
    info = wait_job(slurm_cluster, job, timeout=limit("long"), restarts=1)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log.read_text()[-3000:]
    assert wait_job(slurm_cluster, high, timeout=limit("minute"))["JobState"] == "COMPLETED"
    # the log read once it has the requeued run's end (a loaded CI run read it without the restart's lines)
    resumed = int(wait_for_log(log, r"resumed from \S+step-(\d+)\.pt", timeout=limit("minute")).group(1))
    wait_for_log(log, "training completed", timeout=limit("minute"))
    text = log.read_text()
    assert "DUE TO PREEMPTION" in text
    stopped = int(re.search(r"received SIGTERM: checkpointing at epoch \d+ step (\d+)", text).group(1))
    assert stopped - 4 <= resumed <= stopped      # at most one checkpoint interval (every_steps=4) lost
    assert torch.load(tmp_path / "runs" / job / "checkpoints" / "final.pt", weights_only=True)["global_step"] == 8 * 2


def test_usr1_to_the_batch_shell_is_forwarded_and_requeues(slurm_cluster, tmp_path):
    cfg = toy_config(tmp_path, epochs=6, sleep=0.2)
    job = submit_script(slurm_cluster, tmp_path, "tisasrec_2node.sbatch", "--ntasks-per-node=1",
                        "--gpus-per-node=1", "--cpus-per-task=1",
                        env=dict(CONFIG=cfg, TRAINER_PLUGINS="tests.toy_recipe", EXTRA="optim.lr=0.002"))
    log = tmp_path / f"tisasrec-{job}.out"
    wait_for_log(log, r"step 5 loss")
    # what --signal=B:USR1@120 does before the time limit: only the batch shell gets it
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm_env(slurm_cluster), check=True)
    info = wait_job(slurm_cluster, job, timeout=limit("long"), restarts=1)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", text[-3000:]
    assert "received SIGUSR1" in text and f"requeued Slurm job {job}" in text
    assert re.search(r"resumed from \S+step-\d+\.pt", text)
    ckpt = torch.load(tmp_path / "runs" / job / "checkpoints" / "final.pt", weights_only=True)
    assert ckpt["world_size"] == 2 and ckpt["config"]["optim"]["lr"] == 0.002


def test_image_runs_tasks_through_apptainer(slurm_cluster, tmp_path):
    """No apptainer here: a stand-in on PATH records its arguments and runs the rest with our python."""
    shim = tmp_path / "bin" / "apptainer"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/bash\necho "apptainer $*" >> {tmp_path}/apptainer.calls\n'
                    f'[ "$1 $2 $3" = "exec --nv --bind" ] || exit 9\nshift 6\nexec {PY} "$@"\n')
    shim.chmod(0o755)
    image = tmp_path / "trainer.sif"
    image.write_bytes(b"SIF")
    env = dict(CONFIG=toy_config(tmp_path, epochs=1, sleep=0), TRAINER_PLUGINS="tests.toy_recipe", IMAGE=str(image),
               PATH=f"{shim.parent}:{os.environ['PATH']}")
    job = submit_script(slurm_cluster, tmp_path, "sasrec_1node.sbatch", "--ntasks-per-node=2", "--gpus-per-node=2",
                        "--cpus-per-task=1", env=env)
    info = wait_job(slurm_cluster, job, timeout=limit("start"))
    assert info["JobState"] == "COMPLETED", (tmp_path / f"sasrec-{job}.out").read_text()[-3000:]
    calls = (tmp_path / "apptainer.calls").read_text().splitlines()
    assert len(calls) == 2 and all(
        c.startswith(f"apptainer exec --nv --bind {tmp_path} {image} python -m trainer train")
                                   for c in calls)
    missing = submit_script(slurm_cluster, tmp_path, "sasrec_1node.sbatch", "--ntasks-per-node=1",
                            "--gpus-per-node=1", "--cpus-per-task=1", env=dict(env, IMAGE=str(tmp_path / "no.sif")))
    assert wait_job(slurm_cluster, missing, timeout=limit("run"))["JobState"] == "FAILED"
    assert "no.sif: no such file" in (tmp_path / f"sasrec-{missing}.out").read_text()


def test_predict_stops_at_the_time_limit_warning_and_the_requeued_job_continues_from_its_parts(slurm_cluster,
                                                                                                tmp_path):
    """slurm/predict.sbatch, two tasks (the toy recipe's predict: its parts machinery, a sleep per part): USR1 to the
    batch shell (what --signal=B:USR1@120 sends) stops each task after its current part and requeues the job; the
    rerun says how many parts were written and computes the rest; every row once, as one process writes them."""
    from tests.conftest import trainer
    run, out = tmp_path / "toy", tmp_path / "pred.csv"
    trainer("train", "--recipe", "toy", "--epochs", "1", "log.tensorboard=false", "--run-dir", str(run))
    job = submit_script(slurm_cluster, tmp_path, "predict.sbatch", "--ntasks-per-node=2", "--gpus-per-node=2",
                        "--cpus-per-task=1", "--time=10",
                        env=dict(CHECKPOINT=str(run), OUT=str(out), TRAINER_PLUGINS="tests.toy_recipe",
                                 EXTRA="data.step_sleep=0.4 data.n_test=120"), args=("--part-size", "4"))
    log = tmp_path / f"predict-{job}.out"
    wait_for_log(log, r"part 3/15 of rank 0 written")
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm_env(slurm_cluster), check=True)
    info = wait_job(slurm_cluster, job, timeout=limit("long"), restarts=1)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", text[-3000:]
    assert re.search(r"SIGUSR1: rank 0 stops after \d+ of its 15 parts", text) and f"job {job} requeued" in text
    written = int(re.search(r"30 parts of 4, (\d+) already written .* \(continuing\)", text).group(1))
    assert 3 * 2 <= written < 30, text[-3000:]
    rows = out.read_text().splitlines()
    assert rows[0] == "row,rank,y" and [int(r.split(",")[0]) for r in rows[1:]] == list(range(120))
    trainer("predict", "--checkpoint", str(run), "--out", str(tmp_path / "one.csv"), "data.n_test=120")
    one = (tmp_path / "one.csv").read_text().splitlines()
    assert [r.split(",")[2] for r in rows[1:]] == [r.split(",")[2] for r in one[1:]]


def test_a_script_submitted_from_another_directory_finds_its_repository_and_refuses_generated_data(
        slurm_cluster, tmp_path):
    """Issue 73 points 4 and 5, from the user's side: `sbatch /path/to/repo/slurm/sasrec_1node.sbatch` from a folder of
    one's own, no TRAINER_HOME: the script finds its repository from the path Slurm recorded; without a dataset it stops
    at once (exit 2, never relaunched), and with data.synthetic=true it trains on generated data and says so."""
    elsewhere = tmp_path / "my-project"
    elsewhere.mkdir(parents=True)                     # nothing in it: Slurm writes %x-%j.out here
    env = slurm_env(slurm_cluster, PYTHON=PY)
    assert "TRAINER_HOME" not in env
    tiny = ("model.width=16 model.depth=1 model.heads=1 data.maxlen=16 data.synthetic_users=120 "
            "data.synthetic_items=60 log.tensorboard=false")
    jobs = {}
    for name, extra in (("refused", f"data.path= {tiny}"), ("asked", f"data.path= data.synthetic=true {tiny}")):
        out = subprocess.run(["sbatch", "--parsable", "--cpus-per-task=1", "--time=10",
                              str(REPO / "slurm" / "sasrec_1node.sbatch"), "--epochs", "1"], cwd=elsewhere,
                             env=dict(env,
                                      EXTRA=extra), text=True, capture_output=True, check=True, timeout=limit("minute"))
        jobs[name] = out.stdout.strip().split(";")[0]
    refused = wait_job(slurm_cluster, jobs["refused"], timeout=limit("start"))
    log = (elsewhere / f"sasrec-{jobs['refused']}.out").read_text()
    assert refused["JobState"] == "FAILED", log[-2000:]     # every rank exits 2 (srun may report the TERM it sent)
    assert "data.path is empty: this slurm run would train on the recipe's generated data" in log
    assert "relaunching the training step" not in log
    asked = wait_job(slurm_cluster, jobs["asked"], timeout=limit("long"))
    log = (elsewhere / f"sasrec-{jobs['asked']}.out").read_text()
    assert asked["JobState"] == "COMPLETED", log[-3000:]
    run = elsewhere / "runs" / jobs["asked"]                      # RUN_DIR's default: the submit directory's runs/
    assert (run / "config.yaml").read_text().startswith("# trained on generated data (data.path is empty)")
    assert "training on the recipe's generated data" in log and "TRACE_BUFFER_SIZE is deprecated" not in log

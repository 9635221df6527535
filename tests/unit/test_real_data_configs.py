"""A config named after a real dataset never falls back to generated data: without the data it stops with
the data.path it wanted and the command that downloads it (generated data only with an empty data.path)."""
import subprocess

import pytest

from tests.conftest import PY, REPO, clean_env
from tests.timeouts import limit
from trainer.config.settings import build_config
from trainer.data.download import DownloadError, check_data_path

EXPECTED = {
    "sasrec/ml-1m.yaml": "python -m trainer data download ml-1m --out data/",
    "sasrec/ml-100k.yaml": "python -m trainer data download ml-100k --out data/",
    "sasrec/beauty.yaml": "the preprocessed Amazon Beauty of the BERT4Rec paper",
    "tisasrec/ml-1m.yaml": "python -m trainer data download ml-1m --out data/",
    "tisasrec/ml-100k.yaml": "python -m trainer data download ml-100k --out data/",
    "kgat/amazon-book.yaml": "python -m trainer data download amazon-book --out data/",
    "kgat/last-fm.yaml": "python -m trainer data download last-fm --out data/",
    "kgat/yelp2018.yaml": "python -m trainer data download yelp2018 --out data/",
    "kgat/ml-100k-kg.yaml": "data convert movielens-kg --src data/ml-100k --out data/ml-100k-kg",
    "har/uci-har.yaml": "python -m trainer data download uci-har --out data/",
    "har/basicmotions.yaml": "copy the dataset there",
    "video/mouse.yaml": "copy the dataset there",
}


def test_every_real_dataset_config_names_its_data():
    real = {str(p.relative_to(REPO / "configs")) for p in (REPO / "configs").rglob("*.yaml")
            if p.stem not in ("demo", "synthetic") and p.parent.name != "search"}     # search/: space files
    assert real == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_real_dataset_config_without_its_data_stops_with_the_download_command(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                       # no data/ here
    cfg = build_config(None, str(REPO / "configs" / name))
    assert cfg.data.path.startswith("data/")
    with pytest.raises(DownloadError) as err:
        check_data_path(cfg.data.path)
    assert f"data.path {cfg.data.path} does not exist" in str(err.value) and EXPECTED[name] in str(err.value)


def test_end_to_end_the_sbatch_default_config_refuses_generated_data(tmp_path):
    """`sbatch slurm/sasrec_1node.sbatch` trains configs/sasrec/ml-1m.yaml; on main it silently trained on
    generated sequences. Now every rank stops at once (before the process group) naming the data."""
    proc = subprocess.run([PY, "-m", "trainer", "train", "--config", str(REPO / "configs/sasrec/ml-1m.yaml")],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=limit("run"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "data.path data/ml-1m does not exist" in proc.stderr and "data download ml-1m" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_sasrec_clips_gradients_as_the_seed_does():
    """Seed 001: "Use gradient clipping (already enabled in main.py)"; the configs had it off."""
    assert build_config("sasrec").optim.clip_grad_norm == 1.0
    for name in ("sasrec/ml-1m.yaml", "sasrec/ml-100k.yaml", "tisasrec/ml-1m.yaml", "tisasrec/ml-100k.yaml",
                 "sasrec/demo.yaml"):
        assert build_config(None, str(REPO / "configs" / name)).optim.clip_grad_norm == 1.0, name
    assert build_config("sasrec", overrides=["optim.clip_grad_norm=0"]).optim.clip_grad_norm == 0   # still off-able

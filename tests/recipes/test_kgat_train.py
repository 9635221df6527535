"""KGAT end to end on synthetic data: the phase sampler, per-phase optimizer state, 2 ranks beat the
popularity ranking on recall@20, sharded evaluation equals single-process, bitwise resume mid-KG-phase."""
import copy

import numpy as np
import pytest
import torch

from tests.conftest import (
    assert_bitwise_equal,
    eval_one_and_three,
    record_fault,
    run_ranks,
    train_until_sigterm,
    weights,
)
from tests.inprocess import cli
from tests.timeouts import limit
from trainer.engine.logging import read_metrics
from trainer.engine.optim import phased
from trainer.recipes.kgat import data as D
from trainer.recipes.kgat.config import KGATDataConfig
from trainer.recipes.kgat.metrics import finalize, topk_sums
from trainer.recipes.kgat.recipe import load_data
from trainer.recipes.kgat.sampling import EpochPlan, PhaseSampler, rows_mask

SMALL = ("--recipe", "kgat", "--seed", "5", "log.tensorboard=false", "optim.name=adam",
         "optim.schedule=constant", "--lr", "0.01", "model.layer_widths=[32,16]", "model.width=32",
         "model.relation_width=32")


def rows(run_dir, split):
    return read_metrics(run_dir, split)


def sampler():
    data = load_data(KGATDataConfig())
    return data, PhaseSampler(data, D.build_ckg(data))


def test_cf_batches_pair_users_with_a_train_positive_and_an_unseen_negative():
    data, s = sampler()
    users, pos, neg = s.cf_batch(np.random.default_rng(0), 200)
    assert len(set(users.tolist())) == 200                          # 300 users: drawn without replacement
    assert len(s.cf_batch(np.random.default_rng(0), 500)[0]) == 500  # more than the users: with replacement
    for u, p, n in zip(users.tolist(), pos.tolist(), neg.tolist()):
        assert p in data.train[u] and n not in data.train[u] and 0 <= n < data.n_items


def test_kg_batches_take_a_real_edge_and_a_corrupted_tail():
    data, s = sampler()
    g = D.build_ckg(data)
    edges = set(zip(g.heads.tolist(), g.rels.tolist(), g.tails.tolist()))
    h, r, pt, nt = s.kg_batch(np.random.default_rng(1), 400)
    for triple in zip(h.tolist(), r.tolist(), pt.tolist(), nt.tolist()):
        assert triple[:3] in edges and (triple[0], triple[1], triple[3]) not in edges
        assert 0 <= triple[3] < g.n_nodes


def test_epoch_plan_follows_the_batch_rule_and_is_reproducible_per_rank_and_batch():
    _, s = sampler()
    one = EpochPlan(s, epoch=3, seed=7, rank=0, world=1, cf_batch=64, kg_batch=128)
    two = [EpochPlan(s, 3, 7, rank, 2, 64, 128) for rank in range(2)]
    assert one.n_cf_steps == s.n_cf // 64 + 1 and one.n_kg_steps == s.n_kg // 128 + 1
    assert two[0].n_cf_steps == s.n_cf // 128 + 1 and two[0].n_kg_steps == s.n_kg // 256 + 1
    assert [b["phase"] for b in one] == ["cf"] * one.n_cf_steps + ["kg"] * one.n_kg_steps
    again = EpochPlan(s, 3, 7, 0, 1, 64, 128)
    for i in (0, one.n_cf_steps + 2):
        assert all(torch.equal(a, b) for a, b in zip(one[i]["tensors"], again[i]["tensors"]))
    assert not torch.equal(two[0][0]["tensors"][0], two[1][0]["tensors"][0])       # ranks differ
    assert not torch.equal(one[0]["tensors"][0], EpochPlan(s, 4, 7, 0, 1, 64, 128)[0]["tensors"][0])


def test_rows_mask_marks_each_rows_items():
    ptr, idx = torch.tensor([0, 2, 2, 5]), torch.tensor([1, 3, 0, 2, 4])
    mask = rows_mask(ptr, idx, torch.tensor([2, 1, 0]), 5)
    assert mask.tolist() == [[True, False, True, False, True], [False] * 5, [False, True, False, True, False]]


def test_phased_optimizer_keeps_one_state_per_phase_and_round_trips():
    w = torch.nn.Parameter(torch.ones(3))
    opt = phased(torch.optim.Adam)([w], phases=("cf", "kg"), lr=0.1)
    for phase, grad in (("cf", 1.0), ("kg", -2.0), ("cf", 1.0)):
        opt.set_phase(phase)
        w.grad = torch.full((3,), grad)
        opt.step()
    sd = opt.state_dict()
    assert sd["phases"]["cf"]["state"][0]["step"] == 2 and sd["phases"]["kg"]["state"][0]["step"] == 1
    assert torch.allclose(sd["phases"]["kg"]["state"][0]["exp_avg"], torch.full((3,), -0.2))
    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = phased(torch.optim.Adam)([w2], phases=("cf", "kg"), lr=0.1)
    opt2.load_state_dict(copy.deepcopy(sd))     # state_dict() shares the live tensors
    for o, p in ((opt, w), (opt2, w2)):
        o.set_phase("kg")
        p.grad = torch.ones(3)
        o.step()
    assert torch.equal(w, w2)


def popularity_recall20(cfg: KGATDataConfig) -> float:
    """recall@20 of ranking the items by training popularity (train and validation items excluded)."""
    d = load_data(cfg)
    pop = torch.tensor(np.bincount(np.concatenate(d.train), minlength=d.n_items), dtype=torch.float64)
    users = [u for u in range(d.n_users) if len(d.test[u])]
    scores, mask = pop.repeat(len(users), 1), torch.zeros(len(users), d.n_items, dtype=torch.bool)
    for k, u in enumerate(users):
        scores[k, d.train[u]] = scores[k, d.val[u]] = float("-inf")
        mask[k, d.test[u]] = True
    return finalize(topk_sums(scores, mask, (20,)))["recall@20"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("kgat")
    run_ranks(2, "train", *SMALL, "--epochs", "4", "--batch-size", "64", "--run-dir", str(run_dir),
              timeout=limit("jobs"))
    return run_dir


def test_two_rank_ddp_beats_popularity_on_recall20(trained):
    baseline = popularity_recall20(KGATDataConfig())
    test = rows(trained, "test")[-1]
    assert test["users"] == 300 and test["recall@100"] >= test["recall@20"]
    assert test["recall@20"] > baseline + 0.05, (test["recall@20"], baseline)
    epochs = [r for r in rows(trained, "train") if "cf_loss" in r]
    assert len(epochs) == 4 and epochs[-1]["cf_loss"] < epochs[0]["cf_loss"]
    assert epochs[-1]["kg_loss"] < epochs[0]["kg_loss"]
    assert all(r["cf_time_s"] > 0 and r["kg_time_s"] > 0 and r["attention_time_s"] > 0 for r in epochs)
    ckpt = torch.load(trained / "checkpoints" / "best.pt", weights_only=True)
    assert ckpt["state"]["best"] == max(r["recall@20"] for r in rows(trained, "val"))
    assert set(ckpt["optimizer"]["phases"]) == {"cf", "kg"} and "attention" in ckpt["model"]
    # no DDP: the loop averages every gradient in one all-reduce after the backward, here through shared memory
    assert "gradients averaged after the backward in one all-reduce: shared memory, 2 ranks on one host" \
        in (trained / "train.log").read_text()


def test_sharded_evaluation_equals_single_process(trained, tmp_path):
    one, three = eval_one_and_three(trained / "checkpoints" / "final.pt", tmp_path, "train.eval_batch_size=13")
    for split in ("val", "test"):
        assert one[split]["users"] == three[split]["users"] > 0
        for key, value in one[split].items():
            assert three[split][key] == pytest.approx(value, abs=1e-6), key


def test_resume_in_the_kg_phase_is_bitwise_exact(tmp_path):
    args = ("train", *SMALL, "--epochs", "2", "--batch-size", "128", "ckpt.every_epochs=1")
    cli(*args, "--run-dir", str(tmp_path / "ref"))
    # SIGTERM 5 steps into epoch 1's KG phase (epoch length: the step of the first epoch's summary)
    n_cf_steps = len(load_data(KGATDataConfig()).pairs("train")[0]) // 128 + 1
    per_epoch = [r["step"] for r in rows(tmp_path / "ref", "train") if "cf_loss" in r][0]
    kill_at = per_epoch + n_cf_steps + 5
    proc = train_until_sigterm("trainer.recipes.kgat.recipe", "KGATRecipe", kill_at, args, tmp_path / "run")
    assert proc.returncode == 143 and f"checkpointing at epoch 1 step {kill_at}" in proc.stderr, proc.stderr[-2000:]
    cli(*args, "--run-dir", str(tmp_path / "run"), "--resume", "auto")
    assert_bitwise_equal(weights(tmp_path / "run"), weights(tmp_path / "ref"))
    a, b = (torch.load(p / "checkpoints" / "final.pt", weights_only=True)["optimizer"] for p in
            (tmp_path / "run", tmp_path / "ref"))
    for phase in ("cf", "kg"):
        for k, st in a["phases"][phase]["state"].items():
            assert torch.equal(st["exp_avg"], b["phases"][phase]["state"][k]["exp_avg"])


def test_hits_by_binary_search_equal_a_dense_mask():
    g = torch.Generator().manual_seed(3)
    sets = [np.sort(torch.randperm(50, generator=g)[:n].numpy()) for n in (0, 1, 5, 20, 49)]
    from trainer.recipes.kgat.sampling import csr, hits_of
    ptr, idx = (torch.from_numpy(x) for x in csr(sets))
    rows = torch.tensor([4, 0, 2, 3, 1, 2])
    top = torch.randint(0, 50, (6, 10), generator=g)
    dense = rows_mask(ptr, idx, rows, 50)
    assert torch.equal(hits_of(ptr, idx, rows, top, 50), dense.gather(1, top))


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_training_keeps_the_sparse_propagation_in_fp32(tmp_path, amp):
    cli("train", *SMALL, "--epochs", "1", "--batch-size", "128", "--amp", amp, "--run-dir", str(tmp_path))
    test = rows(tmp_path, "test")[-1]
    assert 0 < test["recall@20"] <= 1 and test["users"] == 300
    ckpt = torch.load(tmp_path / "checkpoints" / "final.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())


def test_resume_with_another_batch_size_goes_on_with_a_recorded_warning(tmp_path):
    """KGAT's epoch plan depends on the layout: a requeue with another batch size continues at the same fraction
    of the epoch, says what differs, records it in metrics.jsonl, and still ends its schedule exactly."""
    args = ("train", *SMALL, "--epochs", "2", "ckpt.every_epochs=1")
    proc = train_until_sigterm("trainer.recipes.kgat.recipe", "KGATRecipe", 4, (*args, "--batch-size", "128"),
                               tmp_path / "run")
    assert proc.returncode == 143, proc.stderr[-2000:]
    again = cli(*args, "--batch-size", "64", "--run-dir", str(tmp_path / "run"), "--resume", "auto")
    assert "draws each epoch's batches from its own plan" in again.stderr
    note = [n for r in rows(tmp_path / "run", "resume") for n in r["notes"]]
    assert any("epoch 0 continues at batch" in n and "the checkpoint was at 4 of" in n for n in note), note
    final = torch.load(tmp_path / "run" / "checkpoints" / "final.pt", weights_only=True)
    assert final["scheduler"]["last_epoch"] == 2 * final["state"]["batches_in_epoch"]     # accumulation 1
    record_fault("KGAT requeued with another batch size mid-epoch", steps_lost=0,
                 outcome="goes on at the same fraction of the epoch with a warning (its epoch plan depends on the "
                 "layout), recorded in metrics.jsonl")

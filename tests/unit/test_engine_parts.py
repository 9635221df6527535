"""Schedules, LR scaling, batch-size splitting, samplers and metric helpers."""
import math
from types import SimpleNamespace

import pytest
import torch

from trainer.config.settings import OptimConfig, TrainConfig
from trainer.engine.loader import ResumableSampler, ShardSampler, per_rank_batch_size
from trainer.engine.optim import build_scheduler, lr_factor, scaled_lr, warmup_steps
from trainer.recipes.classify.metrics import classification_metrics, confusion_matrix


@pytest.mark.parametrize("rule,world,expected", [("none", 4, 0.1), ("linear", 4, 0.4), ("sqrt", 4, 0.2)])
def test_lr_scaling(rule, world, expected):
    assert scaled_lr(0.1, rule, world) == pytest.approx(expected)


def test_warmup_then_decay_shapes():
    assert [lr_factor(s, 4, 20, "constant") for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, 4, 20, "cosine") == pytest.approx(1.0)
    assert lr_factor(12, 4, 20, "cosine") == pytest.approx(0.5)
    assert lr_factor(12, 4, 20, "linear") == pytest.approx(0.5)
    assert lr_factor(20, 4, 20, "cosine", min_ratio=0.1) == pytest.approx(0.1)
    assert lr_factor(100, 0, 20, "constant") == 1.0


def test_warmup_epochs_convert_to_steps_and_scheduler_steps():
    oc = OptimConfig(warmup_epochs=1.5, warmup_steps=2, lr=1.0, schedule="linear")
    assert warmup_steps(oc, 10) == 15
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, oc, TrainConfig(epochs=3), 10)
    lrs = []
    for _ in range(30):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(1 / 15) and lrs[14] == pytest.approx(1.0)
    assert lrs[29] == pytest.approx(1 / 15) and max(lrs) == pytest.approx(1.0)


@pytest.mark.parametrize("bs,gbs,accum,world,expected", [(32, 0, 1, 4, 32), (0, 64, 2, 4, 8), (0, 64, 1, 1, 64)])
def test_per_rank_batch_size(bs, gbs, accum, world, expected):
    tc = SimpleNamespace(batch_size=bs, global_batch_size=gbs, grad_accum_steps=accum)
    assert per_rank_batch_size(tc, world) == expected


def test_indivisible_global_batch_size_has_hint():
    tc = SimpleNamespace(batch_size=0, global_batch_size=30, grad_accum_steps=1)
    with pytest.raises(ValueError, match="HINT"):
        per_rank_batch_size(tc, 4)


def test_resumable_sampler_partitions_and_resumes():
    n, world = 23, 3
    samplers = [ResumableSampler(n, r, world, shuffle=True, seed=5) for r in range(world)]
    for s in samplers:
        s.set_epoch(2)
    shards = [list(s) for s in samplers]
    assert all(len(x) == math.ceil(n / world) for x in shards)
    assert set(sum(shards, [])) == set(range(n))                 # every sample, padded by repeats
    samplers[1].set_epoch(2, start=3 * world)                    # 3 samples of each rank done
    assert list(samplers[1]) == shards[1][3:] and len(samplers[1]) == len(shards[1]) - 3
    samplers[1].set_epoch(3)
    assert list(samplers[1]) != shards[1]                        # a new permutation each epoch


def test_single_rank_order_matches_union_of_ranks():
    """The global batch of a 2-rank step holds the same samples as the 1-rank batch of twice the size."""
    one = ResumableSampler(16, 0, 1, True, 0)
    r0, r1 = ResumableSampler(16, 0, 2, True, 0), ResumableSampler(16, 1, 2, True, 0)
    assert set(list(one)[:8]) == set(list(r0)[:4] + list(r1)[:4])


def test_cost_dealing_balances_ranks_and_keeps_the_global_batches():
    """With per-sample costs, each global batch is the same set as plain striding gives, but dealt by cost:
    the ranks' summed costs per step differ by at most one sample's cost, where plain striding is lopsided."""
    n, world, batch = 50, 2, 5
    costs = [(7 * i) % 50 + 1 for i in range(n)]
    plain = [list(ResumableSampler(n, r, world, True, 3)) for r in range(world)]
    dealt = [ResumableSampler(n, r, world, True, 3, costs=costs, batch_size=batch) for r in range(world)]
    for s in dealt:
        s.set_epoch(0)
    shards = [list(s) for s in dealt]
    gaps_plain, gaps_dealt = [], []
    for step in range(n // (world * batch)):
        cut = slice(step * batch, (step + 1) * batch)
        assert set(shards[0][cut] + shards[1][cut]) == set(plain[0][cut] + plain[1][cut])
        per_rank = [sum(costs[i] for i in shard[cut]) for shard in shards]
        assert abs(per_rank[0] - per_rank[1]) <= max(costs)
        gaps_dealt.append(abs(per_rank[0] - per_rank[1]))
        gaps_plain.append(abs(sum(costs[i] for i in plain[0][cut]) - sum(costs[i] for i in plain[1][cut])))
    assert sum(gaps_dealt) < sum(gaps_plain)
    dealt[1].set_epoch(0, start=world * batch)                       # resuming after a step: the same tail
    assert list(dealt[1]) == shards[1][batch:]
    assert list(ResumableSampler(n, 0, 1, True, 3, costs=costs, batch_size=batch)) == \
        list(ResumableSampler(n, 0, 1, True, 3))                     # one rank: nothing to balance
    with pytest.raises(ValueError, match="3 sample costs for a dataset of 50"):
        ResumableSampler(n, 0, 2, True, 3, costs=[1, 2, 3], batch_size=batch)


def test_shard_sampler_covers_each_sample_once():
    shards = [list(ShardSampler(10, r, 4)) for r in range(4)]
    assert sorted(sum(shards, [])) == list(range(10)) and [len(s) for s in shards] == [3, 3, 2, 2]


def test_classification_metrics_match_hand_computation():
    pred = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    true = torch.tensor([0, 1, 1, 1, 2, 0, 2])
    cm = confusion_matrix(pred, true, 3)
    assert cm.tolist() == [[1, 0, 1], [1, 2, 0], [0, 0, 2]]
    m = classification_metrics(cm, ["a", "b", "c"])
    assert m["accuracy"] == pytest.approx(5 / 7)
    f1 = [2 * 0.5 * 0.5 / 1.0, 2 * 1 * (2 / 3) / (1 + 2 / 3), 2 * (2 / 3) * 1 / (1 + 2 / 3)]
    assert [m["f1/a"], m["f1/b"], m["f1/c"]] == pytest.approx(f1)
    assert m["macro_f1"] == pytest.approx(sum(f1) / 3)


def test_optimizer_uses_configured_betas_and_scaled_lr():
    from trainer.engine.optim import build_optimizer
    tc = OptimConfig(name="adam", betas=[0.9, 0.98], lr=0.01, lr_scaling="linear")
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], tc, world_size=4)
    assert type(opt) is torch.optim.Adam
    assert opt.param_groups[0]["betas"] == (0.9, 0.98) and opt.param_groups[0]["lr"] == pytest.approx(0.04)


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_fused_optimizer_makes_the_reference_updates(name):
    """The configured Adam/AdamW is the fused kernel; 30 steps with weight decay track torch's reference loop
    (the per-element update is the same; only the rounding order may differ)."""
    from trainer.engine.optim import build_optimizer
    tc = OptimConfig(name=name, betas=[0.9, 0.98], lr=0.01, weight_decay=0.1)
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(300, 7))
    b, start = torch.nn.Parameter(a.detach().clone()), a.detach().clone()
    fused = build_optimizer([a], tc, world_size=1)
    assert fused.param_groups[0]["fused"] is True
    ref = type(fused)([b], lr=0.01, betas=(0.9, 0.98), weight_decay=0.1, foreach=False)
    for step in range(30):
        grad = torch.randn(300, 7) * (step % 3)        # zero gradients on every third step, as for unused rows
        a.grad, b.grad = grad.clone(), grad.clone()
        fused.step(), ref.step()
    assert (a - b).abs().max().item() < 1e-6 and (a.detach() - start).abs().max() > 0.1      # and it moved


def test_amp_auto_is_off_on_cpu_and_explicit_modes_map_to_dtypes():
    from trainer.engine.build import amp_dtype
    cpu = torch.device("cpu")
    assert amp_dtype("auto", cpu) is None and amp_dtype("off", cpu) is None
    assert amp_dtype("bf16", cpu) is torch.bfloat16 and amp_dtype("fp16", cpu) is torch.float16


@pytest.mark.parametrize("best,best_tie,metrics,expected", [
    (None, None, {"macro_f1": 0.5, "loss": 1.0}, True),
    (0.9, 0.3, {"macro_f1": 0.95, "loss": 9.0}, True),      # the primary metric decides first
    (0.9, 0.3, {"macro_f1": 0.8, "loss": 0.1}, False),
    (1.0, 0.3, {"macro_f1": 1.0, "loss": 0.2}, True),       # equal: the tie-break metric (lower loss)
    (1.0, 0.3, {"macro_f1": 1.0, "loss": 0.3}, False),
])
def test_best_checkpoint_tie_break(best, best_tie, metrics, expected):
    from trainer.engine.selection import Selection
    from trainer.engine.state import TrainState
    recipe = SimpleNamespace(tie_break_metric=("loss", "min"), primary_metric=("macro_f1", "max"))
    cfg = SimpleNamespace(recipe="har", train=SimpleNamespace(select_metric=""))
    selection = Selection(recipe, cfg, TrainState(best=best, best_tie=best_tie))
    assert selection.improved(metrics) is expected


def test_throughput_counts_the_time_spent_waiting_for_batches():
    import time as _time

    from trainer.engine.meters import Throughput

    def slow_loader():
        for i in range(3):
            _time.sleep(0.02)            # a lower bound on each wait, whatever the machine's load
            yield i

    meter = Throughput()
    assert list(meter.timed(slow_loader())) == [0, 1, 2]
    assert meter.waited >= 0.06
    rates = meter.rates()
    assert 0 < rates["data_wait_frac"] <= 1
    meter.reset()
    assert meter.waited == 0 and meter.rates()["data_wait_frac"] < 1


def test_progress_bars_start_no_monitor_thread():
    # DataLoader workers are forked; tqdm's monitor thread running at a fork once left a worker hung
    import subprocess
    import sys
    code = ("import threading; from tqdm._monitor import TMonitor; from trainer.native.console import progress_bar\n"
            "bar = progress_bar(total=3, disable=False); bar.update(2)\n"
            "print(sum(isinstance(t, TMonitor) for t in threading.enumerate())); bar.close()\n"
            "from tqdm.auto import tqdm; tqdm.monitor_interval = 10; other = tqdm(total=3, disable=False)\n"
            "print(sum(isinstance(t, TMonitor) for t in threading.enumerate())); other.close()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "1"]          # and a plain bar does start one: the check can fail


def test_per_rank_logs_write_one_file_per_rank(tmp_path):
    """Issue 19.5 (TorchX #373): log.per_rank; rank 0's train.log stays rank 0's."""
    import logging

    from trainer.distributed.runtime import DistInfo
    from trainer.engine.logging import setup_logging
    for rank in (1, 0):
        setup_logging(DistInfo(rank=rank, world_size=2), tmp_path, per_rank=True)
        logging.getLogger("trainer.test").info("hello from %d", rank)
    setup_logging(DistInfo(), None)                      # detach the file handlers again
    assert "[rank 1] hello from 1" in (tmp_path / "train.rank1.log").read_text()
    assert "[rank 0] hello from 0" in (tmp_path / "train.rank0.log").read_text()
    assert "hello from 1" not in (tmp_path / "train.log").read_text()


def test_requeue_signals_name_any_catchable_signal():
    from trainer.engine.preemption import trapped_signals
    assert trapped_signals(["SIGUSR1"], "SIGURG") == ["SIGUSR1", "SIGUSR2", "SIGTERM", "SIGURG"]
    assert "SIGHUP" in trapped_signals(["SIGHUP"])
    for bad in ("SIGKILL", "SIGFOO", "USR1"):
        with pytest.raises(ValueError, match=f"'{bad}' is not a signal this process can catch"):
            trapped_signals([bad])


def test_sync_timer_counts_own_collectives_and_the_buckets_wait_after_them(tmp_path):
    """log.measure_sync: a recipe's blocking collective in the backward is its own time; DDP's buckets add
    only what they take beyond its end (before it this rank was busy, not waiting)."""
    import time

    import torch.distributed as dist

    from trainer.distributed.gradsync import GradSyncTimer
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        timer = GradSyncTimer()
        timer.ready, timer.finished = 10.0, 10.004
        assert timer.take() == pytest.approx(0.004) and timer.take() == 0.0        # reset after each step
        with timer.timed():
            time.sleep(0.02)
        own, end = timer.own, timer.own_end
        assert own >= 0.02
        timer.ready, timer.finished = end - 0.015, end - 0.001     # the buckets finished inside it: no extra
        assert timer.take() == pytest.approx(own)
        with timer.timed():
            pass
        timer.ready, timer.finished = timer.own_end - 0.01, timer.own_end + 0.003
        assert timer.take() == pytest.approx(0.003, abs=1e-3)             # the empty one's ~0 + 3 ms after
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("costs", [None, "lengths"])
def test_sampler_position_is_global_across_world_and_batch_changes(costs):
    """An epoch of 50 samples cut 2 ranks x 4, then 1 x 6, then 3 x 5: every sample once, apart from the
    padding that evens out the last layout's ranks (at most world - 1 repeats)."""
    n = 50
    cost = [(7 * i) % 11 + 1 for i in range(n)] if costs else None
    seen, position = [], 0
    for world, batch, steps in ((2, 4, 3), (1, 6, 2), (3, 5, None)):
        shards = []
        for rank in range(world):
            s = ResumableSampler(n, rank, world, True, 9, costs=cost, batch_size=batch)
            s.set_epoch(4, position)
            shards.append(list(s))
        take = len(shards[0]) if steps is None else steps * batch
        for shard in shards:
            seen += shard[:take]
        position = min(position + take * world, n)
    counts = torch.bincount(torch.tensor(seen), minlength=n)
    assert counts.min() == 1 and int((counts - 1).sum()) <= 3 - 1
    with pytest.raises(ValueError, match="outside an epoch of 50"):
        ResumableSampler(n).set_epoch(0, 51)

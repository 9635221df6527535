"""KG steps update only their batch's embedding rows (model.kg_update=sparse): the same gradient as the dense
path, Adam on those rows only (torch's SparseAdam), and under DDP every rank's gradient the ranks' mean, the
table's rows sent instead of the table (`python -m torch.distributed.run --nproc-per-node 2 THIS_FILE` is the
two-rank check the last test runs)."""
import contextlib
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import PY, REPO, clean_env, wait_all
from trainer.engine.optim import phased, sparse_rows
from trainer.recipes.kernels import load as cpu_kernels
from trainer.recipes.kernels import unavailable_reason
from trainer.recipes.kgat.model import KGATModelConfig


class _Counted:
    """The C++ kernels, counting the row updates they make (so a test knows the kernel path ran)."""

    def __init__(self, ops):
        self.ops, self.calls = ops, 0

    def adam_rows_(self, *args):
        self.calls += 1
        return self.ops.adam_rows_(*args)


def _ops_or_skip():
    ops = cpu_kernels()
    if ops is None:
        why = f"the C++ kernels are not built here: {unavailable_reason()}"
        print(f"SKIP: {why}", file=sys.stderr)
        pytest.skip(why)
    return ops


@pytest.fixture(params=["torch", "kernel", "fixed"])
def rows_of(request):
    """base -> sparse_rows(base, ...): each row-update test runs on torch's path, on the C++ kernel
    (kgat_kernels.inc adam_rows_) and on the fixed-shape update of the GPU-shaped step (adam_rows_fixed_)."""
    if request.param != "kernel":
        yield lambda base: sparse_rows(base, fixed=request.param == "fixed")
        return
    counted = _Counted(_ops_or_skip())
    yield lambda base: sparse_rows(base, counted)
    assert counted.calls > 0, "the kernel path did not run"


def kg_grads(update: str) -> dict[str, torch.Tensor]:
    from tests.recipes.test_kgat_model import model_for, small_graph
    d, g = small_graph()
    m = model_for(d, g, kg_update=update)
    h, r, t = (torch.as_tensor(d.kg[:, k]) for k in (0, 1, 2))
    m("kg", h, r, t, torch.flip(t, (0,))).backward()
    return {name: p.grad for name, p in m.named_parameters() if p.grad is not None}


def test_the_sparse_kg_gradient_is_the_dense_one():
    sparse, dense = kg_grads("sparse"), kg_grads("dense")
    assert sparse["embed"].is_sparse and not dense["embed"].is_sparse
    assert set(sparse) == set(dense) == {"embed", "relation", "trans"}
    for name in dense:
        assert torch.allclose(sparse[name].to_dense(), dense[name], atol=1e-7), name


def table_step(table, w, rows):
    F.embedding(rows, table, sparse=True).pow(2).sum().backward()
    (w * 3).pow(2).sum().backward()


def test_rows_follow_sparse_adam_and_dense_parameters_follow_adam(rows_of):
    torch.manual_seed(0)
    table, w = torch.nn.Parameter(torch.randn(12, 4)), torch.nn.Parameter(torch.randn(5))
    ref_table, ref_w = (torch.nn.Parameter(p.detach().clone()) for p in (table, w))
    opt = phased(rows_of(torch.optim.Adam))([table, w], phases=("cf", "kg"), lr=0.05, fused=True)
    opt.set_phase("kg")
    refs = torch.optim.SparseAdam([ref_table], lr=0.05), torch.optim.Adam([ref_w], lr=0.05)
    untouched = table.detach()[11].clone()
    for rows in ([1, 3, 3, 7], [0, 2, 5, 1], [7, 7, 7, 2]):
        for t, p in ((table, w), (ref_table, ref_w)):
            table_step(t, p, torch.tensor(rows))
        opt.step(), opt.zero_grad()
        for o in refs:
            o.step(), o.zero_grad()
    assert torch.allclose(table, ref_table, atol=1e-6) and torch.allclose(w, ref_w, atol=1e-6)
    assert torch.equal(table.detach()[11], untouched)                     # never in a batch: never moved
    assert int(opt.state_dict()["phases"]["kg"]["state"][0]["step"]) == 3
    assert not opt.state_dict()["phases"]["cf"]["state"]                   # the other phase's state untouched


def test_one_shared_state_takes_dense_and_row_steps_alike(rows_of):
    """model.phase_optimizers=shared: the CF phase's dense (fused) steps and the KG phase's row steps share the
    table's Adam state, its step count included."""
    torch.manual_seed(4)
    table = torch.nn.Parameter(torch.randn(8, 3))
    opt = rows_of(torch.optim.Adam)([table], lr=0.1, fused=True)
    for sparse in (True, False, True):
        rows = torch.tensor([1, 6])
        F.embedding(rows, table, sparse=sparse).sum().backward()
        opt.step(), opt.zero_grad()
    state = opt.state[table]
    assert float(state["step"]) == 3 and state["step"].device == table.device
    assert torch.isfinite(table).all() and state["exp_avg"][[0, 2, 3]].abs().sum() == 0


def test_adamw_decays_only_the_batch_rows(rows_of):
    torch.manual_seed(1)
    table = torch.nn.Parameter(torch.randn(6, 3))
    rows = torch.tensor([4, 1])
    ref = torch.nn.Parameter(table.detach()[rows].clone())   # AdamW on just those rows: the same update
    before = table.detach().clone()
    opt = rows_of(torch.optim.AdamW)([table], lr=0.1, weight_decay=0.5, fused=True)
    ref_opt = torch.optim.AdamW([ref], lr=0.1, weight_decay=0.5)
    F.embedding(rows, table, sparse=True).sum().backward()
    ref.sum().backward()
    opt.step(), ref_opt.step()
    assert torch.allclose(table.detach()[rows], ref.detach(), atol=1e-6)
    others = [0, 2, 3, 5]
    assert torch.equal(table.detach()[others], before[others])


def test_a_grad_scaler_skips_an_inf_step_and_unscales_a_finite_one(rows_of):
    torch.manual_seed(2)
    table, w = torch.nn.Parameter(torch.randn(6, 3)), torch.nn.Parameter(torch.randn(3))
    ref_table = torch.nn.Parameter(table.detach().clone())
    opt = rows_of(torch.optim.Adam)([table, w], lr=0.1, fused=True)
    ref_opt = torch.optim.SparseAdam([ref_table], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    rows = torch.tensor([0, 5])
    before = table.detach().clone()
    scaler.scale(F.embedding(rows, table, sparse=True).sum() * float("inf") + w.sum()).backward()
    scaler.step(opt), scaler.update(), opt.zero_grad()
    assert torch.equal(table.detach(), before)                              # the inf step was skipped
    scaler.scale(F.embedding(rows, table, sparse=True).pow(2).sum() + w.sum()).backward()
    scaler.step(opt), scaler.update()
    F.embedding(rows, ref_table, sparse=True).pow(2).sum().backward()
    ref_opt.step()
    assert torch.allclose(table, ref_table, atol=1e-6) and not torch.equal(table.detach(), before)


@pytest.mark.parametrize("cls, decay", [(torch.optim.Adam, 0.0), (torch.optim.Adam, 0.1), (torch.optim.AdamW, 0.1)])
def test_the_row_kernel_is_torchs_row_update(cls, decay):
    """At a KG batch's shape (rows repeated up to many times, more rows than a prefetch distance, width 64)
    the C++ row update gives torch's path's parameters and moments, with L2 or decoupled weight decay."""
    kernel = _Counted(_ops_or_skip())
    torch.manual_seed(7)
    tables = [torch.nn.Parameter(torch.randn(300, 64)) for _ in range(2)]
    with torch.no_grad():
        tables[1].copy_(tables[0])
    opts = [sparse_rows(cls, k)([t], lr=0.05, weight_decay=decay, fused=True) for t, k in zip(tables, (None, kernel))]
    for _ in range(3):
        rows = torch.randint(0, 300, (700,))
        for t, o in zip(tables, opts):
            F.embedding(rows, t, sparse=True).sin().sum().backward()
            o.step(), o.zero_grad()
    assert torch.allclose(tables[1], tables[0], atol=1e-6)
    for key in ("exp_avg", "exp_avg_sq"):
        # (a row's repeated values are summed in another order: the last bits differ)
        assert torch.allclose(opts[1].state[tables[1]][key], opts[0].state[tables[0]][key], atol=1e-6), key
    assert kernel.calls == 3


@pytest.mark.parametrize("cls, decay", [(torch.optim.Adam, 0.0), (torch.optim.Adam, 0.1), (torch.optim.AdamW, 0.1)])
def test_the_fixed_shape_row_update_is_torchs_and_reads_nothing_on_the_host(cls, decay):
    """The GPU-shaped step's row update (no coalesce, the step count and lr on the device) at a KG batch's shape:
    torch's path's parameters and moments; a learning rate held as a tensor (a step graph's) the same; the
    per-row sums' table zero again after each step, and not in the checkpoint."""
    from bench.opcount import OpCount
    torch.manual_seed(8)
    tables = [torch.nn.Parameter(torch.randn(300, 64)) for _ in range(3)]
    with torch.no_grad():
        for t in tables[1:]:
            t.copy_(tables[0])
    opts = [sparse_rows(cls, fixed=f)([t], lr=0.05, weight_decay=decay, fused=True)
            for t, f in zip(tables, (False, True, True))]
    opts[2].param_groups[0]["lr"] = torch.tensor(0.05, dtype=torch.float64)
    counted = OpCount()
    for k in range(3):
        rows = torch.randint(0, 280, (700,))            # rows 280-299 in no batch
        for t, o in zip(tables, opts):
            F.embedding(rows, t, sparse=True).sin().sum().backward()
            with counted if o is opts[1] else contextlib.nullcontext():
                o.step()
            o.zero_grad()
    assert counted.syncs == 0, counted.sync_names
    never = (opts[0].state[tables[0]]["exp_avg"] == 0).all(1)                 # rows no batch named
    assert never[280:].all() and int(never.sum()) < 300
    for t, o in zip(tables[1:], opts[1:]):
        # the update's arithmetic in another order (a division, then the step size): 1e-6 apart after 3 steps
        assert torch.allclose(t, tables[0], rtol=0, atol=1e-5) and torch.equal(t[never], tables[0][never])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(o.state[t][key], opts[0].state[tables[0]][key], rtol=0, atol=1e-5), key
        assert not o._row_sums[id(t)].any() and set(o.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
        assert float(o.state[t]["step"]) == 3
    assert torch.equal(tables[2], tables[1])          # the learning rate a tensor (a step graph's): the same bits


def test_the_row_kernel_refuses_a_row_out_of_range():
    ops = _ops_or_skip()
    table = torch.zeros(5, 4)
    with pytest.raises(RuntimeError, match="row 5 of 5"):
        ops.adam_rows_(table, torch.zeros(5, 4), torch.zeros(5, 4), torch.tensor([1, 5]), torch.ones(2, 4),
                       0.1, 0.9, 0.999, 1e-8, 0.0, False, 1.0, 1.0)
    assert not table.any()                                  # nothing written before the check


def tiny_recipe(info=None, optimizer: str = "adam"):
    """The KGAT recipe on its built-in synthetic data (no message dropout: two copies must agree)."""
    from trainer.config.settings import OptimConfig, TrainConfig
    from trainer.distributed.runtime import DistInfo
    from trainer.recipes.kgat.config import KGATDataConfig, KGATEvalConfig, KGATLossConfig
    from trainer.recipes.kgat.recipe import KGATRecipe
    info = info or DistInfo(rank=0, local_rank=0, world_size=1, backend="none", local_world_size=1)
    recipe = KGATRecipe(KGATDataConfig(), KGATModelConfig(width=16, relation_width=8, layer_widths=[8], dropout=0.0),
                        TrainConfig(batch_size=64), info, KGATEvalConfig(), seed=3,
                        loss_cfg=KGATLossConfig(), optim_cfg=OptimConfig(name=optimizer))
    recipe.build_datasets()
    return recipe


def test_sgd_and_dataparallel_fall_back_to_dense_updates():
    from trainer.distributed.runtime import DistInfo
    assert tiny_recipe(optimizer="sgd").build_model().cfg.kg_update == "dense"
    dp = DistInfo(dp_devices=(0, 1))            # DataParallel's replicas would reduce sparse gradients
    assert tiny_recipe(dp).build_model().cfg.kg_update == "dense"
    assert tiny_recipe(optimizer="adam").build_model().cfg.kg_update == "sparse"


def two_rank_check() -> None:
    """Under torchrun: one CF and one KG step as the engine runs them (no DDP: every gradient averaged after the
    backward); every rank's gradients must be the mean of the ranks' own (computed on a plain copy), the other
    phase's parameters untouched by AdamW's decay, and the tables equal after the step; then the attention
    refreshed by the ranks together equals one process's and is the same on every rank."""
    import torch.distributed as dist

    from trainer.config.settings import DistConfig
    from trainer.distributed import gradsync
    from trainer.distributed.runtime import DistInfo, attach_local, teardown
    from trainer.engine.build import wrap_model
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    info = DistInfo(rank=rank, local_rank=rank, world_size=world, backend="gloo", local_world_size=world)
    recipe, alone = tiny_recipe(info=info), tiny_recipe()
    recipe.optim_cfg = replace(recipe.optim_cfg, weight_decay=0.05, name="adamw")
    torch.manual_seed(0)
    model = recipe.build_model()
    torch.manual_seed(0)
    plain = alone.build_model()
    wrapped = wrap_model(model, info, DistConfig(), recipe.find_unused_parameters, recipe.broadcast_buffers,
                         not recipe.average_after_backward)
    assert wrapped is model                     # KGAT averages after the backward, outside DDP
    comm = attach_local(info)                   # as runtime.init does: shared memory for the dense grads and rows
    assert comm is not None
    timer = gradsync.GradSyncTimer(comm)        # as log.measure_sync wires it
    sync = gradsync.after_backward(list(model.parameters()), info, timer)
    opt = recipe.build_optimizer(wrapped, 0.01)
    plan = recipe.epoch_batches(0)
    for batch in (plan[0], plan[plan.n_cf_steps]):
        with torch.no_grad():                    # the copy starts each step from the trained weights
            for p, q in zip(model.parameters(), plain.parameters()):
                q.copy_(p)
        recipe.before_step(batch)
        recipe.training_step(wrapped, batch).backward()
        sync()
        plain(batch["phase"], *batch["tensors"]).backward()
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert (p.grad is None) == (q.grad is None), (batch["phase"], name)
            if q.grad is None:
                continue
            mean = q.grad.to_dense()
            dist.all_reduce(mean)
            assert torch.allclose(p.grad.to_dense(), mean / world, atol=1e-6), (batch["phase"], name)
        assert model.embed.grad.is_sparse == (batch["phase"] == "kg")
        unused = {n: p.detach().clone() for n, p in model.named_parameters() if p.grad is None}
        assert unused, batch["phase"]            # the other phase's parameters: no gradient, so no update
        own = timer.own                          # the averaging counted as waiting in collectives
        assert own > 0 and timer.take() >= own, batch["phase"]
        opt.step(), opt.zero_grad(set_to_none=True), plain.zero_grad(set_to_none=True)
        assert all(torch.equal(p, unused[n]) for n, p in model.named_parameters() if n in unused), batch["phase"]
        tables = [torch.empty_like(model.embed) for _ in range(world)]
        dist.all_gather(tables, model.embed.detach())
        assert all(torch.equal(tables[0], t) for t in tables)
    recipe.on_epoch_end(0, wrapped)             # each rank scores half of the edges, then all of them normalise
    with torch.no_grad():
        for p, q in zip(model.parameters(), plain.parameters()):
            q.copy_(p)
    plain.refresh_attention()
    assert torch.allclose(model.attention, plain.attention, atol=1e-6) and model.attention.sum() > 0
    attention = [torch.empty_like(model.attention) for _ in range(world)]
    dist.all_gather(attention, model.attention)
    assert all(torch.equal(attention[0], a) for a in attention)       # the same bits on every rank
    if rank == 0:
        print("TWO-RANK OK", file=sys.stderr)
    teardown(info)


def test_two_ranks_average_the_table_gradient_in_both_phases():
    proc = subprocess.Popen([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(REPO / "tests" / "recipes" / "test_kgat_sparse_rows.py")], cwd=REPO,
                            env=clean_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    (code, err), = wait_all([proc], 180)
    assert code == 0 and "TWO-RANK OK" in err, err[-4000:]


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    two_rank_check()

"""Launcher detection, layout and validation from tables of environment dicts."""
import re

import pytest

from trainer.distributed.environment import (
    EnvRankEnvironment,
    LaunchError,
    LocalEnvironment,
    SlurmEnvironment,
    SubmititEnvironment,
    TorchrunEnvironment,
    parse_tasks_per_node,
    port_from_job_id,
    select_environment,
)
from trainer.distributed.runtime import choose_backend

SRUN_2x2 = dict(SLURM_JOB_ID="4242", SLURM_PROCID="3", SLURM_LOCALID="1", SLURM_NODEID="1", SLURM_STEP_ID="0",
                SLURM_NTASKS="4", SLURM_STEP_NUM_TASKS="4", SLURM_NNODES="2", SLURM_STEP_NUM_NODES="2",
                SLURM_JOB_NODELIST="gpu-a100-[07-08]", SLURM_STEP_NODELIST="gpu-a100-[07-08]",
                SLURM_TASKS_PER_NODE="2(x2)", SLURM_STEP_TASKS_PER_NODE="2(x2)", SLURM_NTASKS_PER_NODE="2")
TORCHRUN = dict(TORCHELASTIC_RUN_ID="abc", RANK="5", LOCAL_RANK="1", WORLD_SIZE="8", LOCAL_WORLD_SIZE="4",
                GROUP_RANK="1", MASTER_ADDR="10.0.0.1", MASTER_PORT="29400")
SUBMITIT = dict(SRUN_2x2, SUBMITIT_EXECUTOR="slurm", SUBMITIT_FOLDER="/x")
SUBMITIT_LOCAL = dict(SUBMITIT_EXECUTOR="local", SUBMITIT_LOCAL_GLOBALID="1", SUBMITIT_LOCAL_LOCALID="1",
                      SUBMITIT_LOCAL_NTASKS="2", SUBMITIT_LOCAL_JOB_ID="777")
BATCH_SCRIPT = dict(SLURM_JOB_ID="9", SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_JOB_NODELIST="node1")

# inside `salloc -N2 --ntasks-per-node=4` / `sbatch -N2 --ntasks-per-node=4`, as Slurm 22.05 sets them (seen on the
# local cluster): the allocation's SLURM_NTASKS_PER_NODE stays in every step; the step's own counts say otherwise
ALLOC_2x4 = dict(SLURM_JOB_ID="77", SLURM_JOB_NUM_NODES="2", SLURM_NTASKS_PER_NODE="4", SLURM_JOB_NODELIST="node[1-2]",
                 SLURM_NODELIST="node[1-2]")
SRUN_N1 = dict(ALLOC_2x4, SLURM_STEP_ID="0", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NNODES="1",
               SLURM_NTASKS="1", SLURM_TASKS_PER_NODE="1", SLURM_STEP_NUM_TASKS="1", SLURM_STEP_NUM_NODES="1",
               SLURM_STEP_TASKS_PER_NODE="1", SLURM_STEP_NODELIST="node1")
SRUN_N1_n2 = dict(SRUN_N1, SLURM_STEP_ID="1", SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_NTASKS="2",
                  SLURM_TASKS_PER_NODE="2", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="2")
SRUN_N2_n2 = dict(ALLOC_2x4, SLURM_STEP_ID="2", SLURM_PROCID="1", SLURM_LOCALID="0", SLURM_NODEID="1",
                  SLURM_NNODES="2", SLURM_NTASKS="2", SLURM_TASKS_PER_NODE="1(x2)", SLURM_STEP_NUM_TASKS="2",
                  SLURM_STEP_NUM_NODES="2", SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_STEP_NODELIST="node[1-2]")
SALLOC_8 = dict(SLURM_JOB_ID="78", SLURM_NNODES="2", SLURM_NTASKS="8", SLURM_JOB_NODELIST="node[1-2]")
VIRTUAL = dict(TORCHRUN, LOCAL_RANK="0", CUDA_VISIBLE_DEVICES="5")        # torchrun --virtual-local-rank
KUBEFLOW = dict(RANK="3", WORLD_SIZE="4", MASTER_ADDR="job-master-0", MASTER_PORT="23456")  # PyTorchJob: no LOCAL_RANK
NO_NODE_COUNT = {k: v for k, v in SRUN_2x2.items() if k not in ("SLURM_NNODES", "SLURM_STEP_NUM_NODES")}

# env -> (class, rank, local_rank, world, node_rank, local_world, master_addr, master_port)
TABLE = [
    ({}, LocalEnvironment, 0, 0, 1, 0, 1, "127.0.0.1", 29500),
    (SRUN_2x2, SlurmEnvironment, 3, 1, 4, 1, 2, "gpu-a100-07", port_from_job_id("4242")),
    (dict(SRUN_2x2, MASTER_ADDR="head", MASTER_PORT="1234"), SlurmEnvironment, 3, 1, 4, 1, 2, "head", 1234),
    (TORCHRUN, TorchrunEnvironment, 5, 1, 8, 1, 4, "10.0.0.1", 29400),
    (dict(SRUN_2x2, **TORCHRUN), TorchrunEnvironment, 5, 1, 8, 1, 4, "10.0.0.1", 29400),  # torchrun in sbatch
    (dict(RANK="1", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="5"),
     TorchrunEnvironment, 1, 0, 2, 1, 1, "h", 5),  # manual launch: no LOCAL_WORLD_SIZE/GROUP_RANK
    (SUBMITIT, SubmititEnvironment, 3, 1, 4, 1, 2, "gpu-a100-07", port_from_job_id("4242")),
    (SUBMITIT_LOCAL, SubmititEnvironment, 1, 1, 2, 0, 2, "127.0.0.1", port_from_job_id("777")),
    (BATCH_SCRIPT, SlurmEnvironment, 0, 0, 1, 0, 1, "node1", port_from_job_id("9")),
    (dict(RANK="0"), LocalEnvironment, 0, 0, 1, 0, 1, "127.0.0.1", 29500),  # half-set torchrun: not detected
    # steps smaller than their allocation: srun -n1, srun -N1 -n2, srun -N2 -n2 inside -N2 --ntasks-per-node=4
    (SRUN_N1, SlurmEnvironment, 0, 0, 1, 0, 1, "node1", port_from_job_id("77", 0)),
    (SRUN_N1_n2, SlurmEnvironment, 1, 1, 2, 0, 2, "node1", port_from_job_id("77", 1)),
    (SRUN_N2_n2, SlurmEnvironment, 1, 0, 2, 1, 1, "node1", port_from_job_id("77", 2)),
    (NO_NODE_COUNT, SlurmEnvironment, 3, 1, 4, 1, 2, "gpu-a100-07", port_from_job_id("4242")),  # nodes: the list
    (dict(BATCH_SCRIPT, SLURM_STEP_ID="4294967292"), SlurmEnvironment, 0, 0, 1, 0, 1, "node1",  # the extern step
     port_from_job_id("9")),
    (dict(SALLOC_8, SLURM_NTASKS="1"), SlurmEnvironment, 0, 0, 1, 0, 1, "node1", port_from_job_id("78")),
    (VIRTUAL, TorchrunEnvironment, 5, 1, 8, 1, 4, "10.0.0.1", 29400),          # its place on the node, not 0
    (KUBEFLOW, EnvRankEnvironment, 3, 0, 4, 3, 1, "job-master-0", 23456),
]


@pytest.mark.parametrize("env,cls,rank,local,world,node,local_world,addr,port", TABLE)
def test_detection_and_layout(env, cls, rank, local, world, node, local_world, addr, port):
    e = select_environment(env)
    assert type(e) is cls
    assert (e.rank, e.local_rank, e.world_size, e.node_rank, e.local_world_size) == \
        (rank, local, world, node, local_world)
    assert (e.master_addr, e.master_port) == (addr, port)
    e.validate("ddp")


@pytest.mark.parametrize("env,missing", [
    ({k: v for k, v in SRUN_2x2.items() if k not in ("SLURM_LOCALID",)}, "SLURM_LOCALID"),
    ({k: v for k, v in SRUN_2x2.items() if k not in ("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS")}, "SLURM_NTASKS"),
    ({k: v for k, v in TORCHRUN.items() if k != "WORLD_SIZE"}, "WORLD_SIZE"),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, "MASTER_ADDR"),
    (dict(SRUN_2x2, SLURM_PROCID="x"), "SLURM_PROCID"),
])
def test_half_set_environment_names_the_variable(env, missing):
    e = select_environment(env)
    with pytest.raises(LaunchError, match=missing):
        e.validate("ddp")
        e.master_addr, e.master_port  # noqa: B018


def test_missing_nodelist_has_hint():
    env = {k: v for k, v in SRUN_2x2.items() if "NODELIST" not in k}
    with pytest.raises(LaunchError, match="HINT"):
        select_environment(env).master_addr  # noqa: B018


VALIDATION = [
    # python under sbatch without srun while 4 tasks were asked for
    (dict(BATCH_SCRIPT, SLURM_NTASKS="4"), "ddp", "without srun"),
    # a step whose own counts disagree (a wrapper that set some of srun's variables by hand)
    (dict(SRUN_2x2, SLURM_STEP_TASKS_PER_NODE="3(x2)"), "ddp", "SLURM_STEP_TASKS_PER_NODE=3(x2) adds up to 6"),
    # an salloc shell: the job's 8 tasks, no step
    (SALLOC_8, "ddp", "started without srun"),
    (dict(SALLOC_8, SLURM_STEP_ID="4294967290"), "ddp", "started without srun"),     # Slurm's interactive step
    # a world larger than one that no launcher explains
    (dict(WORLD_SIZE="4"), "ddp", "WORLD_SIZE=4 says this process is one of several"),
    (dict(OMPI_COMM_WORLD_SIZE="2"), "ddp", "OMPI_COMM_WORLD_SIZE=2"),
    (dict(SRUN_2x2, SLURM_PROCID="9"), "ddp", "outside world size"),
]


@pytest.mark.parametrize("env,strategy,message", VALIDATION)
def test_validation_fails_fast_with_hint(env, strategy, message):
    with pytest.raises(LaunchError) as err:
        select_environment(env).validate(strategy)
    assert message in str(err.value)
    assert "HINT" in str(err.value) or "outside" in str(err.value)


def test_backend_choice():
    assert choose_backend("auto", "cuda:0") == "nccl"
    assert choose_backend("auto", "cpu") == "gloo"
    assert choose_backend("gloo", "cuda:0") == "gloo"


def test_port_from_job_id_range_and_spread():
    ports = {port_from_job_id(str(j)) for j in range(1000, 1100)}
    assert len(ports) == 100 and all(15000 <= p < 30000 for p in ports)


def test_ports_differ_for_two_steps_of_a_job_and_for_job_ids_15000_apart():
    """Seen on main: both cases gave the same MASTER_PORT (15000 + job id mod 15000)."""
    step = lambda job, s: SlurmEnvironment(dict(SRUN_2x2, SLURM_JOB_ID=job, SLURM_STEP_ID=s)).master_port  # noqa: E731
    assert step("4242", "0") != step("4242", "1") != step("4242", "2") != step("4242", "0")
    for job in (4242, 15000, 123456):
        assert len({port_from_job_id(str(job + k * 15000)) for k in range(50)}) == 50
    assert 15000 <= port_from_job_id("9999999999", 99) < 30000
    # the batch script (no step) and MASTER_PORT still work as before
    assert SlurmEnvironment(BATCH_SCRIPT).master_port == port_from_job_id("9")
    assert SlurmEnvironment(dict(SRUN_2x2, SLURM_STEP_ID="3", MASTER_PORT="2345")).master_port == 2345


@pytest.mark.parametrize("spec,counts", [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2(x2)", [1, 2, 2])])
def test_tasks_per_node(spec, counts):
    assert parse_tasks_per_node(spec) == counts


@pytest.mark.parametrize("var", ["SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
                                 "SLURM_NODEID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES", "MASTER_PORT"])
@pytest.mark.parametrize("value", ["four", "2.5", "4(x2)", " "])
def test_a_non_integer_slurm_count_is_an_error_naming_the_variable(var, value):
    """Seen on main: SLURM_NTASKS_PER_NODE=four ended in a ValueError traceback from int()."""
    env = SlurmEnvironment(dict(SRUN_2x2, **{var: value}))
    with pytest.raises(LaunchError, match=re.escape(f"{var}='{value}' is not an integer")):
        env.validate()
        env.master_port


@pytest.mark.parametrize("env,requeue_id", [
    (SRUN_2x2, "4242"),
    (dict(SRUN_2x2, SLURM_JOB_ID="500", SLURM_ARRAY_JOB_ID="500", SLURM_ARRAY_TASK_ID="0"), "500_0"),
    (dict(SRUN_2x2, SLURM_JOB_ID="503", SLURM_ARRAY_JOB_ID="500", SLURM_ARRAY_TASK_ID="2"), "500_2"),
    (dict(SRUN_2x2, **TORCHRUN, SLURM_ARRAY_JOB_ID="4242", SLURM_ARRAY_TASK_ID="1"), "4242_1"),  # torchrun in sbatch
    (TORCHRUN, None),                     # torchrun outside Slurm: nothing to requeue
    (SUBMITIT, None),                     # submitit requeues through its own checkpoint()
    ({}, None),
])
def test_the_job_to_requeue_is_the_array_task_not_the_array(env, requeue_id):
    """Seen on main: `scontrol requeue $SLURM_JOB_ID` from array task 0 named the array, requeueing every task."""
    assert select_environment(env).requeue_id == requeue_id


@pytest.mark.parametrize("env,can", [(SRUN_2x2, True), (TORCHRUN, False), (SUBMITIT, True), ({}, False),
                                     (dict(SUBMITIT, SUBMITIT_EXECUTOR="local"), False)])
def test_can_requeue_is_a_launch_fact_of_the_environment(env, can):
    assert select_environment(env).can_requeue is can


@pytest.mark.parametrize("env,name", [(SUBMITIT, "SIGUSR2"), (dict(SUBMITIT, SUBMITIT_PREEMPT_SIGNAL="URG"), "SIGURG"),
                                      (dict(SUBMITIT, SUBMITIT_PREEMPT_SIGNAL="SIGUSR1"), "SIGUSR1"),
                                      (SRUN_2x2, None), (TORCHRUN, None)])
def test_preempt_signal_is_submitits_where_submitit_launched(env, name):
    assert select_environment(env).preempt_signal == name


def test_a_bad_submitit_preempt_signal_is_an_error_naming_the_variable():
    with pytest.raises(LaunchError, match="SUBMITIT_PREEMPT_SIGNAL='USR9' is not a signal name"):
        select_environment(dict(SUBMITIT, SUBMITIT_PREEMPT_SIGNAL="USR9")).preempt_signal


def test_restart_count():
    assert select_environment(dict(SRUN_2x2, SLURM_RESTART_COUNT="2")).restart_count == 2
    assert select_environment(SRUN_2x2).restart_count == 0
    with pytest.raises(LaunchError, match="SLURM_RESTART_COUNT='x'"):
        select_environment(dict(SRUN_2x2, SLURM_RESTART_COUNT="x")).restart_count


AGENT = ["/venv/bin/python", "-m", "torch.distributed.run", "--nproc-per-node", "2"]


@pytest.mark.parametrize("argv,env,seconds", [
    (AGENT + ["-m", "trainer", "train"], {}, 30.0),                                       # torch's default
    (AGENT + ["--shutdown-timeout", "120", "-m", "trainer"], {}, 120.0),
    (AGENT + ["--shutdown_timeout=45", "-m", "trainer"], {}, 45.0),
    (["/venv/bin/torchrun", "--shutdown-timeout=7", "train.py"], {}, 7.0),
    (AGENT + ["-m", "trainer"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "90"}, 90.0),
    (AGENT + ["-m", "trainer"], {"PET_SHUTDOWN_TIMEOUT": "60", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "90"}, 60.0),
    # the flag wins over the environment; the training script's own flags are not torchrun's
    (AGENT + ["--shutdown-timeout", "5", "-m", "trainer"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "90"}, 5.0),
    (AGENT + ["-m", "trainer", "--shutdown-timeout", "5"], {}, 30.0),
])
def test_torchruns_shutdown_limit_is_read_from_the_agents_command_line_or_environment(argv, env, seconds):
    from trainer.distributed.environment import agent_shutdown_s
    assert agent_shutdown_s(env, argv) == seconds


def test_a_bad_shutdown_limit_names_the_flag():
    from trainer.distributed.environment import agent_shutdown_s
    with pytest.raises(LaunchError, match="--shutdown-timeout='soon'"):
        agent_shutdown_s({}, AGENT + ["--shutdown-timeout", "soon"])


def test_the_agents_forwarded_signals_are_a_launch_fact():
    assert select_environment(TORCHRUN).agent_signals == ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    env = dict(TORCHRUN, TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM, SIGUSR1")
    assert select_environment(env).agent_signals == ("SIGTERM", "SIGUSR1")
    manual = {k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_RUN_ID"}   # RANK/LOCAL_RANK, no agent
    assert select_environment(manual).agent_signals is None and select_environment(manual).agent_shutdown_s is None
    assert select_environment(SRUN_2x2).agent_signals is None


def test_requeue_signals_the_agent_does_not_forward_matter_only_where_a_requeue_follows():
    from trainer.distributed.runtime import DistInfo
    from trainer.engine.preemption import unforwarded_signals
    trapped = ["SIGUSR1", "SIGUSR2", "SIGTERM", "SIGURG"]
    agent = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    assert unforwarded_signals(DistInfo(agent_signals=agent, can_requeue=True), trapped) == \
        ["SIGUSR1", "SIGUSR2", "SIGURG"]
    assert unforwarded_signals(DistInfo(agent_signals=agent, can_requeue=False), trapped) == []
    assert unforwarded_signals(DistInfo(agent_signals=None, can_requeue=True), trapped) == []
    assert unforwarded_signals(DistInfo(agent_signals=(*agent, "SIGUSR1", "SIGUSR2", "SIGURG"), can_requeue=True),
                               trapped) == []


def test_the_shutdown_budget_warns_once_when_a_step_and_a_checkpoint_outlast_the_limit(caplog):
    from trainer.distributed.runtime import DistInfo
    from trainer.engine.components.budget import ShutdownBudget
    budget = ShutdownBudget(DistInfo(agent_shutdown_s=30.0))
    for seconds in (100.0, 20.0, 25.0):       # the first step (warm-up) does not count
        budget.step(seconds)
    budget.saved(4.0)
    assert not budget.warned                   # 25 + 4 <= 30
    budget.saved(6.0)
    assert budget.warned and "take 31.0 s here, but torchrun kills its workers 30 s" in caplog.text
    assert "--shutdown-timeout 72" in caplog.text       # twice what is needed, plus 10 s
    budget.saved(60.0)
    assert caplog.text.count("a step plus a checkpoint") == 1
    assert not ShutdownBudget(DistInfo()).warned


def test_lightnings_shape_is_detected_and_counted_before_its_ranks_are_read():
    """LOCAL_RANK, NODE_RANK, WORLD_SIZE and no RANK: the processes meet on MASTER_PORT first (trained for real in
    tests/distributed/test_launch_shapes.py); before that the facts it has are read, and the rank is not guessed."""
    from trainer.distributed.environment import NodeRankEnvironment
    env = select_environment(dict(LOCAL_RANK="1", NODE_RANK="2", WORLD_SIZE="8", MASTER_ADDR="h", MASTER_PORT="7"))
    assert type(env) is NodeRankEnvironment and env.needs_agreement
    assert (env.local_rank, env.node_rank, env.world_size) == (1, 2, 8)
    with pytest.raises(LaunchError, match="RANK"):
        env.rank  # noqa: B018
    agreed = NodeRankEnvironment(dict(env.env, RANK="5", LOCAL_WORLD_SIZE="2"))
    assert not agreed.needs_agreement and (agreed.rank, agreed.local_world_size) == (5, 2)
    agreed.validate("ddp")

"""Launch environments: one class per launcher, each with `detect()` and a table of where its facts come from (the
variables tried in order, else a default), selected in a fixed order. A fact no table can hold (torchrun's agent,
the batch script's checks) is a method of its launcher.

    python -c "from trainer.distributed.environment import select_environment; print(select_environment())"
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

from trainer.distributed.hostlist import HostlistError, expand
from trainer.launch.exitcodes import slurm_job_to_requeue  # noqa: F401 - part of this module's API

PORT_BASE, PORT_SPAN = 15000, 15000  # 15000-29999: below Linux's ephemeral range (32768+)


class LaunchError(RuntimeError):
    """The launch environment is inconsistent; the message carries a HINT."""


def port_from_job_id(job_id: str, step_id: str | int = 0) -> int:
    """A port derived from the job and step ids, so that jobs and steps sharing a node differ: consecutive
    job ids, job ids PORT_SPAN apart (the wrap-around shifts by a prime) and two srun steps of one job."""
    job = int(re.sub(r"\D", "", str(job_id)) or 0)
    step = int(step_id) if str(step_id).isdigit() else 0
    return PORT_BASE + (job + (job // PORT_SPAN) * 7919 + step * 1009) % PORT_SPAN


TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")   # what torchrun's agent forwards by default
TORCHRUN_SHUTDOWN_S = 30.0                                       # and how long it waits before SIGKILL


def agent_shutdown_s(env: Mapping[str, str], agent_argv: list[str]) -> float:
    """How long torchrun's agent waits for its workers after forwarding a signal before it SIGKILLs them:
    its --shutdown-timeout flag (read from the agent's command line, the workers' parent), else
    PET_SHUTDOWN_TIMEOUT or TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else torch's 30 s."""
    start = next((i + 1 for i, a in enumerate(agent_argv)
                  if a == "torch.distributed.run" or os.path.basename(a) == "torchrun"), len(agent_argv))
    for i, arg in enumerate(agent_argv[start:], start):
        for flag in ("--shutdown-timeout", "--shutdown_timeout"):
            if arg == flag and i + 1 < len(agent_argv):
                return _seconds(agent_argv[i + 1], flag)
            if arg.startswith(flag + "="):
                return _seconds(arg.split("=", 1)[1], flag)
        if arg in ("-m", "--module") or (not arg.startswith("-") and arg.endswith(".py")):
            break    # the training script's own arguments follow
    for var in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        if env.get(var):
            return _seconds(env[var], var)
    return TORCHRUN_SHUTDOWN_S


def _seconds(raw: str, name: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise LaunchError(f"torchrun: {name}={raw!r} is not a number of seconds") from None


def parent_argv(pid: int | None = None) -> list[str]:
    """The command line of this process's parent (torchrun's agent for its workers); [] where unreadable."""
    try:
        with open(f"/proc/{pid or os.getppid()}/cmdline", "rb") as fh:
            return [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return []


def parse_tasks_per_node(spec: str) -> list[int]:
    """Expand Slurm's compressed task counts: '2(x3),1' -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise LaunchError(f"cannot parse SLURM_TASKS_PER_NODE={spec!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


# Slurm's own steps that are not srun's: the batch script, the extern and interactive steps, a pending step (slurm.h:
# SLURM_INTERACTIVE_STEP 0xfffffffa up to SLURM_BATCH_SCRIPT 0xfffffffe of older releases); by name in newer ones
NOT_SRUN_FROM = 0xFFFFFFFA
NOT_SRUN_NAMES = ("batch", "extern", "interactive", "TBD")


def srun_step(env: Mapping[str, str]) -> str | None:
    """The srun step this process runs in (SLURM_STEP_ID, else SLURM_STEPID); None in a batch script, an salloc
    shell, Slurm's extern or interactive step, or outside Slurm."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", ""))
    if not env.get("SLURM_JOB_ID") or step in NOT_SRUN_NAMES or not step.isdigit():
        return None
    return step if int(step) < NOT_SRUN_FROM else None


REQUIRED = object()


@dataclass(frozen=True)
class Read:
    """One row of a launcher's table: the first of `names` that is set (an empty value is unset), read by `parse`
    (an int unless given); else `default`, a value or a function of the environment (REQUIRED: a LaunchError
    naming the variables)."""
    names: tuple[str, ...]
    default: Any = REQUIRED
    parse: Callable[[LaunchEnvironment, str, str], Any] | None = None


def read(*names: str, default: Any = REQUIRED, parse: Callable | None = None) -> Read:
    return Read(names, default, parse)


def fixed(value: Any) -> Read:
    """A fact this launcher knows without a variable."""
    return Read((), value)


def as_text(env: LaunchEnvironment, name: str, raw: str) -> str:
    return raw


def fact(key: str, doc: str) -> property:
    """A launch fact, read from the launcher's table."""
    return property(lambda self: self.read(key), doc=doc)


class LaunchEnvironment:
    """Base class: where this process sits in the job, read from environment variables through TABLE."""

    name: ClassVar[str] = "base"
    TABLE: ClassVar[dict[str, Read]] = {
        "master_addr": read("MASTER_ADDR", default="127.0.0.1", parse=as_text),
        "master_port": read("MASTER_PORT", default=29500),
        "job_id": read("SLURM_JOB_ID", default=None, parse=as_text),
        "restart_count": read("SLURM_RESTART_COUNT", default=0),
    }

    def __init__(self, env: Mapping[str, str] | None = None):
        self.env = dict(os.environ if env is None else env)
        self.live = env is None   # this process's own environment: its parent process may be read too

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        """True when this launcher started the current process."""
        raise NotImplementedError

    def table(self) -> dict[str, Read]:
        """Where each fact comes from here (a launcher with two modes gives the table of the one it is in)."""
        return self.TABLE

    def read(self, key: str) -> Any:
        return self.value(self.table()[key])

    def value(self, row: Read) -> Any:
        """What one row reads here (also a row outside the table: a variable only a default needs)."""
        for var in row.names:
            if self.env.get(var):
                return (row.parse or as_int)(self, var, self.env[var])
        if row.default is REQUIRED:
            raise missing(self.name, row.names)
        return row.default(self) if callable(row.default) else row.default

    rank = fact("rank", "Global rank of this process.")
    local_rank = fact("local_rank", "Rank of this process on its node.")
    world_size = fact("world_size", "Number of processes in the job step.")
    node_rank = fact("node_rank", "Index of this node in the step.")
    local_world_size = fact("local_world_size", "Number of processes on this node.")
    master_addr = fact("master_addr", "Address of rank 0 for the rendezvous.")
    master_port = fact("master_port", "Port of rank 0 for the rendezvous.")
    job_id = fact("job_id", "Scheduler job id, if any.")
    restart_count = fact("restart_count", "How often Slurm restarted this job (0 outside Slurm).")

    @property
    def step_id(self) -> str | None:
        """The Slurm job step (SLURM_STEP_ID of an srun step; torchrun under srun too); None outside one."""
        return srun_step(self.env)

    @property
    def init_method(self) -> str:
        """Rendezvous URL for init_process_group."""
        return f"tcp://{self.master_addr}:{self.master_port}"

    @property
    def requeue_id(self) -> str | None:
        """The Slurm job rank 0 requeues after a signal checkpoint; None where the launcher does not."""
        return None

    @property
    def can_requeue(self) -> bool:
        """A requeue follows a signal checkpoint: rank 0 runs `scontrol requeue requeue_id` (or submitit does)."""
        return self.requeue_id is not None

    @property
    def preempt_signal(self) -> str | None:
        """A launcher-specific signal that means "checkpoint, then requeue" (None: only ckpt.requeue_signals)."""
        return None

    @property
    def agent_signals(self) -> tuple[str, ...] | None:
        """Signals a launcher agent between Slurm and this process forwards to it (None: no agent)."""
        return None

    @property
    def agent_shutdown_s(self) -> float | None:
        """Seconds that agent waits after forwarding a signal before it kills this process (None: no agent)."""
        return None

    @property
    def needs_agreement(self) -> bool:
        """The processes must count each other (agree()) before this environment knows every rank."""
        return False

    def agree(self, timeout_s: float):
        """(the environment with every fact known, the store the processes met through; None: none)."""
        return self, None

    def validate(self, strategy: str = "ddp") -> None:
        """Raise LaunchError with a HINT when the layout cannot work."""
        if not 0 <= self.rank < self.world_size:
            raise LaunchError(f"{self.name}: rank {self.rank} outside world size {self.world_size}.")
        if not 0 <= self.local_rank < max(self.local_world_size, 1):
            raise LaunchError(f"{self.name}: local rank {self.local_rank} outside local world size "
                              f"{self.local_world_size}.")

    def describe(self) -> dict:
        """The facts, for logs and `doctor`."""
        return dict(launcher=self.name, rank=self.rank, local_rank=self.local_rank,
                    world_size=self.world_size, node_rank=self.node_rank,
                    local_world_size=self.local_world_size, master_addr=self.master_addr,
                    master_port=self.master_port, job_id=self.job_id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"


def as_int(env: LaunchEnvironment, name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{env.name}: {name}={raw!r} is not an integer.") from None


def missing(launcher: str, names: tuple[str, ...]) -> LaunchError:
    what = f"environment variable {names[0]} is missing" if len(names) == 1 else \
        f"none of the environment variables {', '.join(names)} is set"
    return LaunchError(f"{launcher}: {what}.\nHINT: the {launcher} launcher sets it; a half-set environment usually "
                       f"means variables leaked from another shell (unset them) or a wrapper dropped them.")


def torchrun_local_rank(env: LaunchEnvironment, name: str, raw: str) -> int:
    """LOCAL_RANK, but under `torchrun --virtual-local-rank` (every worker LOCAL_RANK=0, each seeing only its own GPU
    as device 0) the worker's place on its node: RANK - GROUP_RANK x LOCAL_WORLD_SIZE (torchrun gives every node the
    same --nproc-per-node). The node's workers then swap their GPUs under distinct keys and elect one cache builder."""
    local = as_int(env, name, raw)
    if local != 0 or "TORCHELASTIC_RUN_ID" not in env.env or not all(
            env.env.get(k, "").isdigit() for k in ("RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE")):
        return local
    place = int(env.env["RANK"]) - int(env.env["GROUP_RANK"]) * int(env.env["LOCAL_WORLD_SIZE"])
    return place if 0 <= place < int(env.env["LOCAL_WORLD_SIZE"]) else local


class TorchrunEnvironment(LaunchEnvironment):
    """torchrun / torch.distributed.run (also inside an sbatch allocation: its variables win)."""

    name = "torchrun"
    TABLE = {
        **LaunchEnvironment.TABLE,
        "rank": read("RANK"),
        "local_rank": read("LOCAL_RANK", parse=torchrun_local_rank),
        "world_size": read("WORLD_SIZE"),
        "local_world_size": read("LOCAL_WORLD_SIZE", default=1),            # a manual launch may leave it out
        "node_rank": read("GROUP_RANK", default=lambda e: e.rank // max(e.local_world_size, 1)),
        "master_addr": read("MASTER_ADDR", parse=as_text),
        "master_port": read("MASTER_PORT"),                                   # 0 with torchrun's agent store
    }

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        """torchrun sets TORCHELASTIC_RUN_ID; a manual launch sets RANK and LOCAL_RANK."""
        return "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "LOCAL_RANK" in env)

    @property
    def init_method(self) -> str:
        """env:// so that torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE) is used when present."""
        return "env://"

    @property
    def requeue_id(self) -> str | None:
        """Inside an sbatch allocation: the job (or array task) torchrun runs in."""
        return slurm_job_to_requeue(self.env)

    @property
    def agent_signals(self) -> tuple[str, ...] | None:
        """TORCHELASTIC_SIGNALS_TO_HANDLE (set by torchrun's --signals-to-handle) or its default; None for
        a manual launch with RANK/LOCAL_RANK (no agent)."""
        if "TORCHELASTIC_RUN_ID" not in self.env:
            return None
        spec = self.env.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
        return tuple(s.strip() for s in spec.split(",") if s.strip()) if spec else TORCHRUN_SIGNALS

    @property
    def agent_shutdown_s(self) -> float | None:
        """torchrun's shutdown timeout (its flag, environment or 30 s); None without an agent."""
        if "TORCHELASTIC_RUN_ID" not in self.env:
            return None
        return agent_shutdown_s(self.env, parent_argv() if self.live else [])


def tasks_here(env: SlurmEnvironment, name: str, raw: str) -> int:
    """This node's entry of Slurm's compressed task counts."""
    counts = parse_tasks_per_node(raw)
    return counts[env.node_rank] if env.node_rank < len(counts) else counts[-1]


def hosts(env: LaunchEnvironment, name: str, raw: str) -> list[str]:
    try:
        return expand(raw)
    except HostlistError as err:
        raise LaunchError(f"{env.name}: cannot parse {name}: {err}") from None


def no_nodelist(env: LaunchEnvironment) -> list[str]:
    raise LaunchError(f"{env.name}: none of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST "
                      f"is set.\nHINT: set MASTER_ADDR to the first node's address.")


def slurm_port(env: SlurmEnvironment) -> int:
    """Derived from the job id and, under srun, the step id: steps and jobs sharing a node differ."""
    step = env.env.get("SLURM_STEP_ID", env.env.get("SLURM_STEPID", "0")) if env.in_step else "0"
    return port_from_job_id(env.value(read("SLURM_JOB_ID", parse=as_text)), step)


class SlurmEnvironment(LaunchEnvironment):
    """Tasks started by `srun` (a plain `python` in a batch script is a world of one, checked)."""

    name = "slurm"
    TABLE = {
        **LaunchEnvironment.TABLE,
        "rank": read("SLURM_PROCID"),
        "local_rank": read("SLURM_LOCALID"),
        "world_size": read("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
        "node_rank": read("SLURM_NODEID"),
        "num_nodes": read("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES",     # srun: the step's
                          default=lambda e: len(e.nodelist)),
        "local_world_size": read("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", parse=tasks_here,
                                 default=lambda e: max(e.world_size // max(e.num_nodes, 1), 1)),
        "nodelist": read("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST", parse=hosts,
                         default=no_nodelist),
        "master_addr": read("MASTER_ADDR", parse=as_text, default=lambda e: e.nodelist[0]),
        "master_port": read("MASTER_PORT", default=slurm_port),
        "asked_tasks": read("SLURM_NTASKS", "SLURM_NPROCS", default=1),
        "tasks_per_node": read("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", parse=as_text, default=""),
    }
    # the batch script or an salloc shell, outside any srun step: a world of one
    OUTSIDE_STEP = {**TABLE, **{key: fixed(0) for key in ("rank", "local_rank", "node_rank")},
                    "world_size": fixed(1), "local_world_size": fixed(1)}

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        """Inside a Slurm job (batch script, salloc shell or srun step)."""
        return "SLURM_JOB_ID" in env

    def table(self) -> dict[str, Read]:
        return self.TABLE if self.in_step else self.OUTSIDE_STEP

    num_nodes = fact("num_nodes", "Nodes of the step (else of the job).")
    nodelist = fact("nodelist", "Hosts of the step (else of the job).")

    @property
    def in_step(self) -> bool:
        """True under srun; false in the batch script, an salloc shell, the extern or interactive step."""
        return srun_step(self.env) is not None

    @property
    def requeue_id(self) -> str | None:
        """SLURM_JOB_ID, or ARRAYID_TASKID for an array task."""
        return slurm_job_to_requeue(self.env)

    def validate(self, strategy: str = "ddp") -> None:
        """Also: tasks vs nodes x tasks-per-node, and python without srun."""
        asked = self.read("asked_tasks")
        if not self.in_step:
            if asked > 1:
                raise LaunchError(
                    f"slurm: this job asked for {asked} tasks (SLURM_NTASKS={asked}) but the trainer was "
                    f"started without srun, so it would run as a world of one.\n"
                    f"HINT: launch it with `srun python -m trainer ...` (or torchrun), not plain `python`.")
            return
        # a step's own counts (srun -n1 inside a -N2 --ntasks-per-node=4 allocation is a step of one task: the
        # allocation's SLURM_NTASKS_PER_NODE, inherited, does not describe it)
        spec = self.read("tasks_per_node")
        if spec:
            counts = parse_tasks_per_node(spec)
            if len(counts) == self.num_nodes and sum(counts) != self.world_size:
                var = next(v for v in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if self.env.get(v))
                raise LaunchError(
                    f"slurm: {var}={spec} adds up to {sum(counts)} tasks on {self.num_nodes} node(s), but the step "
                    f"has {self.world_size} (SLURM_STEP_NUM_TASKS, else SLURM_NTASKS).\n"
                    f"HINT: these come from srun; a wrapper that sets some of them by hand must set all of them.")
        super().validate(strategy)


def local_port(env: LaunchEnvironment) -> int:
    """Derived from submitit's local job id (its executor's pid)."""
    return port_from_job_id(env.value(read("SUBMITIT_LOCAL_JOB_ID", parse=as_text)))


class SubmititEnvironment(SlurmEnvironment):
    """A task started by submitit: on Slurm, Slurm's table (always inside a step); under its local executor, its own."""

    name = "submitit"
    LOCAL = {
        **SlurmEnvironment.TABLE,
        "rank": read("SUBMITIT_LOCAL_GLOBALID"),
        "local_rank": read("SUBMITIT_LOCAL_LOCALID"),
        "world_size": read("SUBMITIT_LOCAL_NTASKS"),
        "node_rank": fixed(0),
        "local_world_size": read(default=lambda e: e.world_size),            # every local task shares the node
        "master_addr": read("MASTER_ADDR", parse=as_text, default="127.0.0.1"),
        "master_port": read("MASTER_PORT", default=local_port),
        "job_id": read("SUBMITIT_LOCAL_JOB_ID", default=None, parse=as_text),
    }

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        """submitit exports SUBMITIT_EXECUTOR in every task it starts."""
        return env.get("SUBMITIT_EXECUTOR", "") in ("slurm", "local")

    def table(self) -> dict[str, Read]:
        return self.LOCAL if self.is_local else self.TABLE

    @property
    def is_local(self) -> bool:
        """True under submitit's local executor (no Slurm)."""
        return self.env.get("SUBMITIT_EXECUTOR") == "local"

    @property
    def in_step(self) -> bool:
        """submitit always runs its tasks as a step (srun) or as local processes."""
        return True

    @property
    def requeue_id(self) -> str | None:
        """None: submitit's own checkpoint() path requeues."""
        return None

    @property
    def can_requeue(self) -> bool:
        """submitit's Slurm executor requeues through TrainTask.checkpoint(); its local executor does not."""
        return not self.is_local

    @property
    def preempt_signal(self) -> str:
        """submitit's preemption signal: SIG + SUBMITIT_PREEMPT_SIGNAL (default USR2), as submitit reads it."""
        import signal
        value = self.env.get("SUBMITIT_PREEMPT_SIGNAL") or "USR2"
        name = value if value.startswith("SIG") else f"SIG{value}"
        if not isinstance(getattr(signal, name, None), signal.Signals):
            raise LaunchError(f"{self.name}: SUBMITIT_PREEMPT_SIGNAL={value!r} is not a signal name (e.g. USR2, URG)")
        return name


class EnvRankEnvironment(LaunchEnvironment):
    """Processes given RANK, WORLD_SIZE and MASTER_ADDR/PORT but no LOCAL_RANK: Kubeflow's PyTorchJob (one process per
    pod), torch's env:// convention. Each process is a node of its own unless LOCAL_RANK/LOCAL_WORLD_SIZE say more."""

    name = "env"
    TABLE = {
        **LaunchEnvironment.TABLE,
        "rank": read("RANK"),
        "local_rank": read("LOCAL_RANK", default=0),
        "world_size": read("WORLD_SIZE"),
        "local_world_size": read("LOCAL_WORLD_SIZE", default=1),
        "node_rank": read("GROUP_RANK", "NODE_RANK", default=lambda e: e.rank // max(e.local_world_size, 1)),
        "master_addr": read("MASTER_ADDR", parse=as_text),
        "master_port": read("MASTER_PORT"),
    }

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        """RANK and WORLD_SIZE set (torchrun's shape has LOCAL_RANK as well)."""
        return "RANK" in env and "WORLD_SIZE" in env


class NodeRankEnvironment(LaunchEnvironment):
    """Lightning's launcher: LOCAL_RANK, NODE_RANK, WORLD_SIZE and MASTER_ADDR/PORT, no RANK. The processes count
    each other through a store on MASTER_ADDR:MASTER_PORT (agree()), which the process group then uses."""

    name = "lightning"
    TABLE = {
        **LaunchEnvironment.TABLE,
        "rank": read("RANK"),                          # set by agree()
        "local_rank": read("LOCAL_RANK"),
        "world_size": read("WORLD_SIZE"),
        "local_world_size": read("LOCAL_WORLD_SIZE"),  # set by agree()
        "node_rank": read("NODE_RANK"),
        "master_addr": read("MASTER_ADDR", parse=as_text),
        "master_port": read("MASTER_PORT"),
    }

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        """NODE_RANK, LOCAL_RANK and WORLD_SIZE without RANK."""
        return all(k in env for k in ("NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")) and "RANK" not in env

    @property
    def needs_agreement(self) -> bool:
        return "RANK" not in self.env or "LOCAL_WORLD_SIZE" not in self.env

    def agree(self, timeout_s: float):
        """(this environment with RANK and LOCAL_WORLD_SIZE, the store): every process adds itself to its node's
        count; once all WORLD_SIZE have, a rank is the count of the lower nodes plus its local rank."""
        import datetime
        import time

        import torch.distributed as dist
        world, node = self.world_size, self.node_rank
        store = dist.TCPStore(self.master_addr, self.master_port, is_master=node == 0 and self.local_rank == 0,
                              timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        store.add(f"trainer/nodes/{node}", 1)
        store.add("trainer/arrived", 1)
        deadline = time.monotonic() + timeout_s
        while (arrived := store.add("trainer/arrived", 0)) < world:
            if time.monotonic() > deadline:
                raise LaunchError(f"lightning: {arrived} of WORLD_SIZE={world} processes reached "
                                  f"{self.master_addr}:{self.master_port} within {timeout_s:.0f} s")
            time.sleep(0.02)
        counts = [store.add(f"trainer/nodes/{n}", 0) for n in range(node + 1)]
        if 0 in counts:
            raise LaunchError(f"lightning: no process has NODE_RANK={counts.index(0)} while this one has "
                              f"NODE_RANK={node}.\nHINT: node ranks count from 0 without gaps.")
        rank = sum(counts[:node]) + self.local_rank
        agreed = NodeRankEnvironment(dict(self.env, RANK=str(rank), LOCAL_WORLD_SIZE=str(counts[node])))
        return agreed, store


def world_vars(env: Mapping[str, str]) -> list[str]:
    """Variables that say the world is larger than one process."""
    sizes = ("WORLD_SIZE", "SLURM_NTASKS", "SLURM_NPROCS", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "LOCAL_WORLD_SIZE")
    return [f"{k}={env[k]}" for k in sizes if env.get(k, "").isdigit() and int(env[k]) > 1]


class LocalEnvironment(LaunchEnvironment):
    """A single local process (also DataParallel over the local GPUs)."""

    name = "local"
    TABLE = {**LaunchEnvironment.TABLE, **{key: fixed(0) for key in ("rank", "local_rank", "node_rank")},
             "world_size": fixed(1), "local_world_size": fixed(1)}

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        """Always true: the fallback."""
        return True

    def validate(self, strategy: str = "ddp") -> None:
        """Never a silent world of one where the environment says the world is larger."""
        if said := world_vars(self.env):
            raise LaunchError(
                f"local: {', '.join(said)} says this process is one of several, but no launcher this trainer "
                f"knows set its rank (RANK with WORLD_SIZE, LOCAL_RANK with NODE_RANK, SLURM_PROCID, ...).\n"
                f"HINT: start it with torchrun or srun, give each process RANK, WORLD_SIZE, MASTER_ADDR and "
                f"MASTER_PORT, or unset {said[0].split('=')[0]} to train as one process.")
        super().validate(strategy)


ENVIRONMENTS: tuple[type[LaunchEnvironment], ...] = (
    TorchrunEnvironment, SubmititEnvironment, NodeRankEnvironment, EnvRankEnvironment, SlurmEnvironment,
    LocalEnvironment)


def select_environment(env: Mapping[str, str] | None = None) -> LaunchEnvironment:
    """The first launcher, in ENVIRONMENTS order, whose detect() is true."""
    facts = dict(os.environ if env is None else env)
    for cls in ENVIRONMENTS:
        if cls.detect(facts):
            return cls(env)
    raise AssertionError("LocalEnvironment.detect() is always true")

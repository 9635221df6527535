"""Launch environments: one class per launcher, each with `detect()`, selected in a fixed order.

    python -c "from trainer.distributed.environment import select_environment; print(select_environment())"
"""
from __future__ import annotations

import os
import re
from typing import ClassVar, Mapping

from trainer.distributed.hostlist import HostlistError, expand

PORT_BASE, PORT_SPAN = 15000, 15000  # 15000-29999: below Linux's ephemeral range (32768+)


class LaunchError(RuntimeError):
    """The launch environment is inconsistent; the message carries a HINT."""


def _get(env: Mapping[str, str], name: str, launcher: str) -> str:
    """A required variable, or a LaunchError naming it."""
    if name not in env or env[name] == "":
        raise LaunchError(f"{launcher}: environment variable {name} is missing.\n"
                          f"HINT: the {launcher} launcher sets it; a half-set environment usually means "
                          f"variables leaked from another shell (unset them) or a wrapper dropped them.")
    return env[name]


def _int(env: Mapping[str, str], name: str, launcher: str, default: int | None = None) -> int:
    """An integer variable (with an optional default), or a LaunchError naming it."""
    if default is not None and not env.get(name):
        return default
    raw = _get(env, name, launcher)
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{launcher}: {name}={raw!r} is not an integer.") from None


def port_from_job_id(job_id: str, step_id: str | int = 0) -> int:
    """A port derived from the job and step ids, so that jobs and steps sharing a node differ: consecutive
    job ids, job ids PORT_SPAN apart (the wrap-around shifts by a prime) and two srun steps of one job."""
    job = int(re.sub(r"\D", "", str(job_id)) or 0)
    step = int(step_id) if str(step_id).isdigit() else 0
    return PORT_BASE + (job + (job // PORT_SPAN) * 7919 + step * 1009) % PORT_SPAN


def slurm_job_to_requeue(env: Mapping[str, str]) -> str | None:
    """SLURM_JOB_ID, or ARRAYID_TASKID inside a job array: one task's job id is the array's own (on Slurm
    22.05 the last task started), and `scontrol requeue` of it would restart every task."""
    if not env.get("SLURM_JOB_ID"):
        return None
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else env["SLURM_JOB_ID"]


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


class LaunchEnvironment:
    """Base class: where this process sits in the job, read from environment variables."""

    name: ClassVar[str] = "base"

    def __init__(self, env: Mapping[str, str] | None = None):
        self.env = dict(os.environ if env is None else env)
        self.live = env is None   # this process's own environment: its parent process may be read too

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        """True when this launcher started the current process."""
        raise NotImplementedError

    @property
    def rank(self) -> int:
        """Global rank of this process."""
        raise NotImplementedError

    @property
    def local_rank(self) -> int:
        """Rank of this process on its node."""
        raise NotImplementedError

    @property
    def world_size(self) -> int:
        """Number of processes in the job step."""
        raise NotImplementedError

    @property
    def node_rank(self) -> int:
        """Index of this node in the step."""
        raise NotImplementedError

    @property
    def local_world_size(self) -> int:
        """Number of processes on this node."""
        raise NotImplementedError

    @property
    def master_addr(self) -> str:
        """Address of rank 0 for the rendezvous."""
        return self.env.get("MASTER_ADDR") or "127.0.0.1"

    @property
    def master_port(self) -> int:
        """Port of rank 0 for the rendezvous."""
        return _int(self.env, "MASTER_PORT", self.name, default=29500)

    @property
    def job_id(self) -> str | None:
        """Scheduler job id, if any."""
        return self.env.get("SLURM_JOB_ID")

    @property
    def step_id(self) -> str | None:
        """The Slurm job step (SLURM_STEP_ID of an srun step; torchrun under srun too); None outside one."""
        step = self.env.get("SLURM_STEP_ID", self.env.get("SLURM_STEPID", ""))
        in_srun = step.isdigit() and step not in ("4294967294", "4294967291")    # not batch/extern
        return step if self.env.get("SLURM_JOB_ID") and in_srun else None

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
    def restart_count(self) -> int:
        """How often Slurm restarted this job (SLURM_RESTART_COUNT; 0 outside Slurm)."""
        return _int(self.env, "SLURM_RESTART_COUNT", self.name, default=0)

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


class TorchrunEnvironment(LaunchEnvironment):
    """torchrun / torch.distributed.run (also inside an sbatch allocation: its variables win)."""

    name = "torchrun"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        """torchrun sets TORCHELASTIC_RUN_ID; a manual launch sets RANK and LOCAL_RANK."""
        return "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "LOCAL_RANK" in env)

    @property
    def rank(self) -> int:
        """RANK."""
        return _int(self.env, "RANK", self.name)

    @property
    def local_rank(self) -> int:
        """LOCAL_RANK."""
        return _int(self.env, "LOCAL_RANK", self.name)

    @property
    def world_size(self) -> int:
        """WORLD_SIZE."""
        return _int(self.env, "WORLD_SIZE", self.name)

    @property
    def local_world_size(self) -> int:
        """LOCAL_WORLD_SIZE (1 when a manual launch leaves it out)."""
        return _int(self.env, "LOCAL_WORLD_SIZE", self.name, default=1)

    @property
    def node_rank(self) -> int:
        """GROUP_RANK, else derived from the rank."""
        return _int(self.env, "GROUP_RANK", self.name, default=self.rank // max(self.local_world_size, 1))

    @property
    def master_addr(self) -> str:
        """MASTER_ADDR (required)."""
        return _get(self.env, "MASTER_ADDR", self.name)

    @property
    def master_port(self) -> int:
        """MASTER_PORT (required; 0 when torchrun's agent store is used)."""
        return _int(self.env, "MASTER_PORT", self.name)

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


class SlurmEnvironment(LaunchEnvironment):
    """Tasks started by `srun` (a plain `python` in a batch script is a world of one, checked)."""

    name = "slurm"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        """Inside a Slurm job (batch script, salloc shell or srun step)."""
        return "SLURM_JOB_ID" in env and "SLURM_PROCID" in env

    @property
    def in_step(self) -> bool:
        """True under srun; false in the batch script or an salloc shell."""
        step = self.env.get("SLURM_STEP_ID", self.env.get("SLURM_STEPID"))
        return step is not None and step not in ("batch", "extern", "4294967294", "4294967291")

    @property
    def rank(self) -> int:
        """SLURM_PROCID."""
        return _int(self.env, "SLURM_PROCID", self.name) if self.in_step else 0

    @property
    def local_rank(self) -> int:
        """SLURM_LOCALID."""
        return _int(self.env, "SLURM_LOCALID", self.name) if self.in_step else 0

    @property
    def world_size(self) -> int:
        """SLURM_STEP_NUM_TASKS, else SLURM_NTASKS."""
        if not self.in_step:
            return 1
        if self.env.get("SLURM_STEP_NUM_TASKS"):
            return _int(self.env, "SLURM_STEP_NUM_TASKS", self.name)
        return _int(self.env, "SLURM_NTASKS", self.name)

    @property
    def node_rank(self) -> int:
        """SLURM_NODEID."""
        return _int(self.env, "SLURM_NODEID", self.name) if self.in_step else 0

    @property
    def num_nodes(self) -> int:
        """SLURM_STEP_NUM_NODES, else SLURM_JOB_NUM_NODES / SLURM_NNODES."""
        for var in ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
            if self.env.get(var):
                return _int(self.env, var, self.name)
        return 1

    @property
    def local_world_size(self) -> int:
        """Tasks on this node, from SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE."""
        if not self.in_step:
            return 1
        spec = self.env.get("SLURM_STEP_TASKS_PER_NODE") or self.env.get("SLURM_TASKS_PER_NODE")
        if not spec:
            return max(self.world_size // max(self.num_nodes, 1), 1)
        counts = parse_tasks_per_node(spec)
        return counts[self.node_rank] if self.node_rank < len(counts) else counts[-1]

    @property
    def nodelist(self) -> list[str]:
        """Hosts of the step (SLURM_STEP_NODELIST, else the job's)."""
        for var in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            if self.env.get(var):
                try:
                    return expand(self.env[var])
                except HostlistError as err:
                    raise LaunchError(f"{self.name}: cannot parse {var}: {err}") from None
        raise LaunchError(f"{self.name}: none of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST "
                          f"is set.\nHINT: set MASTER_ADDR to the first node's address.")

    @property
    def master_addr(self) -> str:
        """MASTER_ADDR if set, else the first host of the step's nodelist."""
        return self.env.get("MASTER_ADDR") or self.nodelist[0]

    @property
    def master_port(self) -> int:
        """MASTER_PORT if set, else derived from SLURM_JOB_ID."""
        if self.env.get("MASTER_PORT"):
            return _int(self.env, "MASTER_PORT", self.name)
        step = self.env.get("SLURM_STEP_ID", self.env.get("SLURM_STEPID", "0")) if self.in_step else "0"
        return port_from_job_id(_get(self.env, "SLURM_JOB_ID", self.name), step)

    @property
    def requeue_id(self) -> str | None:
        """SLURM_JOB_ID, or ARRAYID_TASKID for an array task."""
        return slurm_job_to_requeue(self.env)

    def validate(self, strategy: str = "ddp") -> None:
        """Also: tasks vs nodes x tasks-per-node, and python without srun."""
        asked = _int(self.env, "SLURM_NTASKS", self.name, default=1)
        if not self.in_step:
            if asked > 1:
                raise LaunchError(
                    f"slurm: this job asked for {asked} tasks (SLURM_NTASKS={asked}) but the trainer was "
                    f"started without srun, so it would run as a world of one.\n"
                    f"HINT: launch it with `srun python -m trainer ...` (or torchrun), not plain `python`.")
            return
        tpn = _int(self.env, "SLURM_NTASKS_PER_NODE", self.name, default=0)
        if tpn and self.world_size != self.num_nodes * tpn:
            raise LaunchError(
                f"slurm: SLURM_NTASKS={self.world_size} but {self.num_nodes} node(s) x "
                f"SLURM_NTASKS_PER_NODE={tpn} = {self.num_nodes * tpn}.\n"
                f"HINT: give either --ntasks or --ntasks-per-node, not conflicting values of both.")
        super().validate(strategy)


class SubmititEnvironment(SlurmEnvironment):
    """A task started by submitit (its Slurm or local executor)."""

    name = "submitit"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        """submitit exports SUBMITIT_EXECUTOR in every task it starts."""
        return env.get("SUBMITIT_EXECUTOR", "") in ("slurm", "local")

    @property
    def is_local(self) -> bool:
        """True under submitit's local executor (no Slurm)."""
        return self.env.get("SUBMITIT_EXECUTOR") == "local"

    @property
    def in_step(self) -> bool:
        """submitit always runs its tasks as a step (srun) or as local processes."""
        return True

    @property
    def rank(self) -> int:
        """SUBMITIT_LOCAL_GLOBALID or SLURM_PROCID."""
        return _int(self.env, "SUBMITIT_LOCAL_GLOBALID", self.name) if self.is_local else super().rank

    @property
    def local_rank(self) -> int:
        """SUBMITIT_LOCAL_LOCALID or SLURM_LOCALID."""
        return _int(self.env, "SUBMITIT_LOCAL_LOCALID", self.name) if self.is_local else super().local_rank

    @property
    def world_size(self) -> int:
        """SUBMITIT_LOCAL_NTASKS or the Slurm step's task count."""
        return _int(self.env, "SUBMITIT_LOCAL_NTASKS", self.name) if self.is_local else super().world_size

    @property
    def node_rank(self) -> int:
        """0 locally, else SLURM_NODEID."""
        return 0 if self.is_local else super().node_rank

    @property
    def local_world_size(self) -> int:
        """All local tasks share the one node."""
        return self.world_size if self.is_local else super().local_world_size

    @property
    def master_addr(self) -> str:
        """Loopback locally, else as under Slurm."""
        return self.env.get("MASTER_ADDR") or ("127.0.0.1" if self.is_local else super().master_addr)

    @property
    def master_port(self) -> int:
        """Derived from the job id (the local executor's is its pid)."""
        if self.is_local and not self.env.get("MASTER_PORT"):
            return port_from_job_id(_get(self.env, "SUBMITIT_LOCAL_JOB_ID", self.name))
        return super().master_port

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

    @property
    def job_id(self) -> str | None:
        """SLURM_JOB_ID or the local executor's job id."""
        return self.env.get("SUBMITIT_LOCAL_JOB_ID") if self.is_local else super().job_id


class LocalEnvironment(LaunchEnvironment):
    """A single local process (also DataParallel over the local GPUs)."""

    name = "local"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        """Always true: the fallback."""
        return True

    rank = property(lambda self: 0, doc="Always 0.")
    local_rank = property(lambda self: 0, doc="Always 0.")
    world_size = property(lambda self: 1, doc="Always 1.")
    node_rank = property(lambda self: 0, doc="Always 0.")
    local_world_size = property(lambda self: 1, doc="Always 1.")


ENVIRONMENTS: tuple[type[LaunchEnvironment], ...] = (
    TorchrunEnvironment, SubmititEnvironment, SlurmEnvironment, LocalEnvironment)


def select_environment(env: Mapping[str, str] | None = None) -> LaunchEnvironment:
    """The first launcher, in ENVIRONMENTS order, whose detect() is true."""
    facts = dict(os.environ if env is None else env)
    for cls in ENVIRONMENTS:
        if cls.detect(facts):
            return cls(env)
    raise AssertionError("LocalEnvironment.detect() is always true")

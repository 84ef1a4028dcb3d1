"""Read the launch environment of torchrun, SLURM, Open MPI and PMI/MPICH.

Pure functions over a mapping (``os.environ`` by default), so tests pass plain
dicts and nothing here touches torch or the network.
"""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass
from typing import Literal, Mapping

from ..errors import LaunchEnvironmentError

Launcher = Literal["none", "torchrun", "slurm", "openmpi", "pmi"]

# Ports derived from a job id land in [_PORT_BASE, _PORT_BASE + _PORT_SPAN):
# above the well-known range and below Linux's ephemeral range (32768+), so
# they do not collide with ports the kernel hands out to clients.
_PORT_BASE = 12000
_PORT_SPAN = 20000


@dataclass(frozen=True, slots=True)
class LaunchEnv:
    """Where this process sits in a launched job.

    Attributes:
        launcher: Which launcher's variables were found.
        rank: Global rank.
        local_rank: Rank within this node (selects the GPU).
        world_size: Number of processes in the job.
        local_world_size: Number of processes on this node, when known.
        master_addr: Rendezvous host, or ``None`` when it cannot be known.
        master_port: Rendezvous port, or ``None`` when it cannot be known.
        restart_count: torchrun's restart attempt (0 on the first).
        uses_agent_store: True under torchrun, whose agent already hosts the
            store at ``master_addr:master_port``.
    """

    launcher: Launcher = "none"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0
    uses_agent_store: bool = False

    @property
    def is_distributed(self) -> bool:
        """True when the job has more than one process."""
        return self.world_size > 1


# The launcher each kind of variables comes from, a variable whose presence
# shows it, and how to start it right: every wrong variable is reported as
# "<what is wrong>. The launcher looks like <who> (<marker> is set); <remedy>".
_LAUNCHERS: dict[str, tuple[str, str, str]] = {
    "torchrun": ("torchrun", "RANK",
                 "start the script with `torchrun --nproc_per_node=N script.py`, which sets RANK, WORLD_SIZE, "
                 "LOCAL_RANK, MASTER_ADDR and MASTER_PORT; if you set them yourself, correct {name}, or unset "
                 "them all to run a single process"),
    "slurm": ("SLURM", "SLURM_PROCID",
              "start the tasks with `srun python script.py` and leave the SLURM_* variables to srun "
              "(do not export them yourself)"),
    "openmpi": ("Open MPI", "OMPI_COMM_WORLD_RANK",
                "start the ranks with `mpirun -np N python script.py` and leave the OMPI_COMM_WORLD_* "
                "variables to mpirun"),
    "pmi": ("PMI (MPICH, Intel MPI)", "PMI_RANK",
            "start the ranks with `mpiexec -n N python script.py` and leave the PMI_* and MPI_LOCAL* "
            "variables to mpiexec"),
}


def _launch_error(launcher: Launcher, name: str, problem: str, remedy: str | None = None,
                  marker: str | None = None) -> LaunchEnvironmentError:
    """The one form of every wrong-variable error: what is wrong with ``name``, which launcher, what to do."""
    who, default_marker, how = _LAUNCHERS[launcher]
    return LaunchEnvironmentError(
        f"{problem}. The launcher looks like {who} ({marker or default_marker} is set); "
        f"{remedy or how.format(name=name)}"
    )


def _int(environ: Mapping[str, str], name: str, launcher: Launcher, default: int | None = None,
         minimum: int = 0) -> int | None:
    """``environ[name]`` as an int >= ``minimum``; ``default`` when unset. Set but empty is wrong too."""
    raw = environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise _launch_error(launcher, name, f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise _launch_error(launcher, name, f"{name} must be >= {minimum}, got {raw!r}")
    return value


def derive_port(job_id: str) -> int:
    """A rendezvous port every task of one job computes alike, from the job id.

    Example:
        >>> derive_port("12345") == derive_port("12345")
        True
        >>> 12000 <= derive_port("12345") < 32000
        True
    """
    key = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    return _PORT_BASE + key % _PORT_SPAN


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (p.strip() for p in parts) if p]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM compressed host list, without calling ``scontrol``.

    Example:
        >>> expand_nodelist("gpu[01-03,07],login1")
        ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login1']
        >>> expand_nodelist("rack[1-2]-n[1-2]")
        ['rack1-n1', 'rack1-n2', 'rack2-n1', 'rack2-n2']
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        match = re.search(r"\[([^\]]*)\]", item)
        if not match:
            hosts.append(item)
            continue
        head, tail = item[: match.start()], item[match.end():]
        for rng in match.group(1).split(","):
            lo, _, hi = rng.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise LaunchEnvironmentError(f"cannot parse SLURM node list {nodelist!r}")
            width = len(lo)  # keep zero padding: gpu[01-04] -> gpu01
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.extend(expand_nodelist(f"{head}{n:0{width}d}{tail}"))
    return hosts


def _master_from_env(environ: Mapping[str, str], launcher: Launcher) -> tuple[str | None, int | None]:
    if launcher == "torchrun":
        fix_addr = "export the host name of rank 0's node (torchrun sets it for you)"
        fix_port = "pass a free port with `torchrun --master_port=PORT`, or export one " \
                   "(nn_handler.find_free_port() finds one)"
    else:
        fix_addr = "export the host name of rank 0's node, or unset MASTER_ADDR to let nn_handler choose"
        fix_port = "export a free port (nn_handler.find_free_port() finds one), or unset MASTER_PORT to let " \
                   "nn_handler derive one from the job id"
    addr = environ.get("MASTER_ADDR")
    if addr is not None and not addr.strip():
        raise _launch_error(launcher, "MASTER_ADDR", f"MASTER_ADDR must be a host name or address, got {addr!r}",
                            fix_addr)
    raw = environ.get("MASTER_PORT")
    if raw is None:
        return addr, None
    port = raw.strip()
    # int() would take "+80" and "8_0"; a port is plain digits.
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise _launch_error(launcher, "MASTER_PORT", f"MASTER_PORT must be a TCP port in 1..65535, got {raw!r}",
                            fix_port)
    return addr, int(port)


def _check_ranks(environ: Mapping[str, str], env: LaunchEnv, rank_var: str, size_var: str, local_rank_var: str,
                 local_size_var: str | None) -> LaunchEnv:
    """Check the ranks against the sizes (each is already an int in range on its own)."""
    def bad(var: str, allowed: str, because: str) -> LaunchEnvironmentError:
        return _launch_error(env.launcher, var, f"{var} must be in {allowed} because {because}, "
                                                f"got {environ[var]!r}")

    if not env.rank < env.world_size:
        raise bad(rank_var, f"[0, {env.world_size})", f"{size_var}={env.world_size}")
    local_size = env.local_world_size if local_size_var else None
    if local_size is not None and local_size > env.world_size:
        raise bad(local_size_var, f"[1, {env.world_size}]", f"{size_var}={env.world_size}")
    if local_size is not None and not env.local_rank < local_size:
        raise bad(local_rank_var, f"[0, {local_size})", f"{local_size_var}={local_size}")
    if not env.local_rank < env.world_size:
        raise bad(local_rank_var, f"[0, {env.world_size})", f"{size_var}={env.world_size}")
    return env


def _torchrun(environ: Mapping[str, str]) -> LaunchEnv:
    if "WORLD_SIZE" not in environ:
        raise _launch_error(
            "torchrun", "RANK", f"RANK is set but WORLD_SIZE is not: RANK={environ['RANK']!r} alone does not say "
            "how many processes the job has", "set both (torchrun sets them for you), or unset RANK to run a "
            "single process"
        )
    addr, port = _master_from_env(environ, "torchrun")
    env = LaunchEnv(
        launcher="torchrun",
        rank=_int(environ, "RANK", "torchrun"),
        world_size=_int(environ, "WORLD_SIZE", "torchrun", minimum=1),
        local_rank=_int(environ, "LOCAL_RANK", "torchrun", 0),
        local_world_size=_int(environ, "LOCAL_WORLD_SIZE", "torchrun", minimum=1),
        master_addr=addr,
        master_port=port,
        restart_count=_int(environ, "TORCHELASTIC_RESTART_COUNT", "torchrun", 0),
        uses_agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
    )
    return _check_ranks(environ, env, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _slurm(environ: Mapping[str, str]) -> LaunchEnv:
    addr, port = _master_from_env(environ, "slurm")
    if addr is None and environ.get("SLURM_JOB_NODELIST", environ.get("SLURM_NODELIST")):
        addr = expand_nodelist(environ.get("SLURM_JOB_NODELIST") or environ["SLURM_NODELIST"])[0]
    job_id = environ.get("SLURM_JOB_ID", environ.get("SLURM_JOBID"))
    if port is None and job_id:
        port = derive_port(job_id)
    # Inside a job step (srun), the step's task count is the job's world;
    # SLURM_NTASKS describes the allocation and may be larger.
    size_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
    env = LaunchEnv(
        launcher="slurm",
        rank=_int(environ, "SLURM_PROCID", "slurm"),
        world_size=_int(environ, size_var, "slurm", 1, minimum=1),
        local_rank=_int(environ, "SLURM_LOCALID", "slurm", 0),
        local_world_size=_int(environ, "SLURM_NTASKS_PER_NODE", "slurm", minimum=1),
        master_addr=addr,
        master_port=port,
    )
    # SLURM_NTASKS_PER_NODE describes the allocation; an srun step may place
    # more or fewer tasks per node, so it bounds nothing here.
    return _check_ranks(environ, env, "SLURM_PROCID", size_var, "SLURM_LOCALID", None)


def _mpi(environ: Mapping[str, str], launcher: Launcher, *, rank: str, size: str, local_rank: str,
         local_size: str, job_ids: tuple[str, ...]) -> LaunchEnv:
    world_size = _int(environ, size, launcher, 1, minimum=1)
    local_world_size = _int(environ, local_size, launcher, minimum=1)
    addr, port = _master_from_env(environ, launcher)
    # mpirun/mpiexec provide no rendezvous address. When every rank is on this
    # node, loopback works and the job id (shared by all ranks) gives a port.
    if local_world_size == world_size:
        addr = addr or "127.0.0.1"
        job_id = next((environ[k] for k in job_ids if environ.get(k)), None)
        if port is None and job_id:
            port = derive_port(job_id)
    env = LaunchEnv(
        launcher=launcher,
        rank=_int(environ, rank, launcher),
        world_size=world_size,
        local_rank=_int(environ, local_rank, launcher, 0),
        local_world_size=local_world_size,
        master_addr=addr,
        master_port=port,
    )
    return _check_ranks(environ, env, rank, size, local_rank, local_size)


def _openmpi(environ: Mapping[str, str]) -> LaunchEnv:
    return _mpi(environ, "openmpi", rank="OMPI_COMM_WORLD_RANK", size="OMPI_COMM_WORLD_SIZE",
                local_rank="OMPI_COMM_WORLD_LOCAL_RANK", local_size="OMPI_COMM_WORLD_LOCAL_SIZE",
                job_ids=("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"))


def _pmi(environ: Mapping[str, str]) -> LaunchEnv:
    # MPICH's Hydra: PMI_* for the world, MPI_LOCAL* for this node.
    return _mpi(environ, "pmi", rank="PMI_RANK", size="PMI_SIZE", local_rank="MPI_LOCALRANKID",
                local_size="MPI_LOCALNRANKS", job_ids=("PMI_KVSNAME", "PMIX_NAMESPACE"))


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Find out which launcher started this process, and where it sits in the job.

    Precedence: torchrun-style variables (``RANK``), then Open MPI, then SLURM,
    then PMI. A launcher run inside another (torchrun or mpirun inside a SLURM
    allocation) sets its own variables, which win over the allocation's.

    Args:
        environ: The environment to read; ``os.environ`` when omitted.

    Returns:
        A :class:`LaunchEnv`; ``launcher == "none"`` for a plain ``python`` run.

    Raises:
        LaunchEnvironmentError: A variable is set but wrong (empty, not an
            integer, negative, a rank not below its size, a port outside
            1..65535), or a partner variable is missing (``RANK`` without
            ``WORLD_SIZE``, ``WORLD_SIZE`` without ``RANK``). The message names
            the variable, its value, the launcher it seems to come from and
            what to do.

    Example:
        >>> detect_launch_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}).rank
        1
        >>> detect_launch_env({}).launcher
        'none'
    """
    environ = os.environ if environ is None else environ
    if "RANK" in environ:
        return _torchrun(environ)
    if "OMPI_COMM_WORLD_RANK" in environ:
        return _openmpi(environ)
    if "SLURM_PROCID" in environ and _is_slurm_step(environ):
        return _slurm(environ)
    if "PMI_RANK" in environ:
        return _pmi(environ)
    if environ.get("WORLD_SIZE", "1").strip() != "1":
        # A world of several processes, but nothing says which one this is:
        # running alone would silently train on one process only.
        raise _launch_error(
            "torchrun", "WORLD_SIZE", f"WORLD_SIZE is set but RANK is not: with WORLD_SIZE={environ['WORLD_SIZE']!r} "
            f"this process would run alone, as rank 0 of 1",
            "start the script with `torchrun --nproc_per_node=N script.py`, which sets RANK too; if you set them "
            "yourself, set RANK as well, or unset WORLD_SIZE to run a single process", marker="WORLD_SIZE",
        )
    return LaunchEnv()


def _is_slurm_step(environ: Mapping[str, str]) -> bool:
    # `python train.py` typed in an sbatch script or an salloc shell sees
    # SLURM_PROCID=0 and the allocation's SLURM_NTASKS, but it is a single
    # process: only a task started by srun (which sets SLURM_STEP_NUM_TASKS)
    # is part of a multi-process step.
    return "SLURM_STEP_NUM_TASKS" in environ or "SLURM_NTASKS" not in environ or (
        environ.get("SLURM_NTASKS") == "1"
    )


def slurm_job_without_srun(environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """``(job id, tasks)`` when this plain process runs inside a SLURM allocation of several tasks.

    That is ``python train.py`` typed in an sbatch script (or an salloc shell)
    without ``srun``: the allocation has ``SLURM_NTASKS`` tasks, but only this
    one process runs. ``None`` for an srun task, a one-task allocation, another
    launcher inside the allocation, or no SLURM at all.

    Example:
        >>> slurm_job_without_srun({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"})
        ('77', 4)
    """
    environ = os.environ if environ is None else environ
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    ntasks = environ.get("SLURM_NTASKS", "").strip()
    if not job_id or not ntasks.isdigit() or int(ntasks) < 2 or "SLURM_STEP_NUM_TASKS" in environ:
        return None
    if any(name in environ for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")):
        return None  # torchrun or mpirun started inside the allocation: they know their world
    return job_id, int(ntasks)


def slurm_job_without_srun_message(job_id: str, tasks: int, command: str = "python train.py") -> str:
    """What to tell a process that :func:`slurm_job_without_srun` found alone in its job."""
    return (f"this is SLURM job {job_id} with {tasks} tasks, but this process was not started by srun and runs "
            f"alone (rank 0 of 1, no process group); `srun {command}` starts the {tasks} tasks")


def missing_rendezvous_message(env: LaunchEnv) -> str:
    """Explain which variables are missing to form a process group, and who sets them."""
    missing = [n for n, v in (("MASTER_ADDR", env.master_addr), ("MASTER_PORT", env.master_port)) if v is None]
    hint = {
        "torchrun": "torchrun sets them for you; when launching by hand, export both",
        "openmpi": "mpirun cannot provide them across nodes: export them, e.g. "
        "`mpirun -x MASTER_ADDR=<first host> -x MASTER_PORT=29500 ...`",
        "pmi": "export them, e.g. `mpiexec -genv MASTER_ADDR <first host> -genv MASTER_PORT 29500 ...`",
        "slurm": "export them in the sbatch script, or make sure SLURM_JOB_NODELIST and SLURM_JOB_ID are set",
    }.get(env.launcher, "export both")
    return (
        f"{env.launcher} job with world size {env.world_size} needs {' and '.join(missing)} "
        f"to form a process group ({hint}). Launchers that set them: torchrun, srun (derived by nn_handler)."
    )

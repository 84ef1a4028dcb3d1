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


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw.strip())
    except ValueError:
        raise LaunchEnvironmentError(
            f"environment variable {name} must be an integer, got {raw!r}; "
            f"unset it or fix the launch command that sets it"
        ) from None


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


def _master_from_env(environ: Mapping[str, str]) -> tuple[str | None, int | None]:
    return environ.get("MASTER_ADDR") or None, _int(environ, "MASTER_PORT")


def _check_ranks(env: LaunchEnv, rank_var: str, size_var: str) -> LaunchEnv:
    if env.world_size < 1:
        raise LaunchEnvironmentError(f"{size_var} must be >= 1, got {env.world_size}")
    if not 0 <= env.rank < env.world_size:
        raise LaunchEnvironmentError(
            f"{rank_var} must be in [0, {env.world_size}) because {size_var}={env.world_size}, "
            f"got {env.rank}; check the launch command"
        )
    if env.local_rank < 0:
        raise LaunchEnvironmentError(f"local rank must be >= 0, got {env.local_rank}")
    return env


def _torchrun(environ: Mapping[str, str]) -> LaunchEnv:
    if "WORLD_SIZE" not in environ:
        raise LaunchEnvironmentError(
            "RANK is set but WORLD_SIZE is not; set both (torchrun sets them for you)"
        )
    addr, port = _master_from_env(environ)
    env = LaunchEnv(
        launcher="torchrun",
        rank=_int(environ, "RANK"),
        world_size=_int(environ, "WORLD_SIZE"),
        local_rank=_int(environ, "LOCAL_RANK", 0),
        local_world_size=_int(environ, "LOCAL_WORLD_SIZE"),
        master_addr=addr,
        master_port=port,
        restart_count=_int(environ, "TORCHELASTIC_RESTART_COUNT", 0),
        uses_agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
    )
    return _check_ranks(env, "RANK", "WORLD_SIZE")


def _slurm(environ: Mapping[str, str]) -> LaunchEnv:
    addr, port = _master_from_env(environ)
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
        rank=_int(environ, "SLURM_PROCID"),
        world_size=_int(environ, size_var, 1),
        local_rank=_int(environ, "SLURM_LOCALID", 0),
        local_world_size=_int(environ, "SLURM_NTASKS_PER_NODE"),
        master_addr=addr,
        master_port=port,
    )
    return _check_ranks(env, "SLURM_PROCID", size_var)


def _mpi(environ: Mapping[str, str], launcher: Launcher, *, rank: str, size: str, local_rank: str,
         local_size: str, job_ids: tuple[str, ...]) -> LaunchEnv:
    world_size = _int(environ, size, 1)
    local_world_size = _int(environ, local_size)
    addr, port = _master_from_env(environ)
    # mpirun/mpiexec provide no rendezvous address. When every rank is on this
    # node, loopback works and the job id (shared by all ranks) gives a port.
    if local_world_size == world_size:
        addr = addr or "127.0.0.1"
        job_id = next((environ[k] for k in job_ids if environ.get(k)), None)
        if port is None and job_id:
            port = derive_port(job_id)
    env = LaunchEnv(
        launcher=launcher,
        rank=_int(environ, rank),
        world_size=world_size,
        local_rank=_int(environ, local_rank, 0),
        local_world_size=local_world_size,
        master_addr=addr,
        master_port=port,
    )
    return _check_ranks(env, rank, size)


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
        LaunchEnvironmentError: A variable is not an integer, a rank is out of
            range, or a required partner variable is missing.

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
    return LaunchEnv()


def _is_slurm_step(environ: Mapping[str, str]) -> bool:
    # `python train.py` typed in an sbatch script or an salloc shell sees
    # SLURM_PROCID=0 and the allocation's SLURM_NTASKS, but it is a single
    # process: only a task started by srun (which sets SLURM_STEP_NUM_TASKS)
    # is part of a multi-process step.
    return "SLURM_STEP_NUM_TASKS" in environ or "SLURM_NTASKS" not in environ or (
        environ.get("SLURM_NTASKS") == "1"
    )


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

"""``python -m nn_handler``: an environment report (``info``) and a self-test (``check``).

``info`` answers "what does this machine look like to nn_handler": versions,
CUDA devices, distributed backends, the launcher it detects and the traps it
can see coming (a rendezvous port already taken, CUDA initialised too early,
a socket interface that does not exist, a tiny ``/dev/shm``). ``check`` runs
the real thing once, small: a worker pool on every device, an all-reduce in a
process group and one DDP step, each timed, with a non-zero exit status when
any of them fails. Run it first on a new cluster node.

Private: the command line is the interface.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import platform
import socket
import sys
import time
from typing import Any, Callable, Mapping, TextIO

from . import _sysinfo

__all__ = ["main"]

# torchrun's port when none is given: two jobs on one node that both rely on
# it collide, which is the most common "address already in use".
TORCHRUN_DEFAULT_PORT = 29500
# Docker gives containers 64 MiB of /dev/shm unless told otherwise; workers
# return large tensors through it (and DataLoader workers use it too).
SMALL_SHM_BYTES = 1 << 30

_LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "0.0.0.0", ""}


# ----------------------------------------------------------------------------- info
def _is_local(host: str | None) -> bool:
    if host is None or host in _LOCAL_HOSTS or host.startswith("127."):
        return True
    try:
        return host in (socket.gethostname(), socket.getfqdn())
    except OSError:
        return False


def port_in_use(port: int) -> bool:
    """True when a server could not listen on ``port`` on this machine right now.

    Binds the way a rendezvous store does (all interfaces, ``SO_REUSEADDR``),
    so a port left in ``TIME_WAIT`` by a finished job does not count.

    Example:
        >>> probe = socket.socket()
        >>> probe.bind(("127.0.0.1", 0)); probe.listen()
        >>> port_in_use(probe.getsockname()[1])
        True
        >>> probe.close()
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _interfaces() -> set[str]:
    try:
        return {name for _, name in socket.if_nameindex()}
    except OSError:
        return set()


def _interface_traps(environ: Mapping[str, str], interfaces: set[str]) -> list[str]:
    traps = []
    gloo = environ.get("GLOO_SOCKET_IFNAME")
    if gloo and interfaces:
        missing = [n for n in gloo.split(",") if n and n not in interfaces]
        if missing:
            traps.append(f"GLOO_SOCKET_IFNAME={gloo} names {', '.join(missing)}, which this machine does not have "
                         f"(interfaces: {', '.join(sorted(interfaces))}); gloo groups will fail to start")
    nccl = environ.get("NCCL_SOCKET_IFNAME")
    if nccl and interfaces and not nccl.startswith("^"):
        # NCCL matches prefixes ("eth" selects eth0, eth1), or exact names after "=".
        names = [n for n in nccl.removeprefix("=").split(",") if n]
        exact = nccl.startswith("=")
        if not any(i == n if exact else i.startswith(n) for n in names for i in interfaces):
            traps.append(f"NCCL_SOCKET_IFNAME={nccl} matches none of this machine's interfaces "
                         f"({', '.join(sorted(interfaces))}); nccl groups will fail to start")
    return traps


def find_traps(environ: Mapping[str, str], launch: Any, launch_error: str | None, *, cuda_initialized: bool,
               cuda_count: int, nccl: bool, interfaces: set[str] | None = None,
               shm_bytes: int | None = None) -> list[str]:
    """Known ways a distributed run goes wrong that can be seen before it starts, as sentences.

    Args:
        environ: The environment to read.
        launch: The detected :class:`~nn_handler.utils._env.LaunchEnv`, or ``None`` when it could not be read.
        launch_error: Why it could not be read.
        cuda_initialized: Whether CUDA was already initialised in this process.
        cuda_count: Number of CUDA devices.
        nccl: Whether torch has the nccl backend.
        interfaces: Network interface names (the real ones when omitted).
        shm_bytes: Size of ``/dev/shm`` (``None``: unknown or absent).

    Returns:
        One warning per trap found; empty when none.

    Example:
        >>> find_traps({}, None, "RANK is set but WORLD_SIZE is not", cuda_initialized=False,
        ...            cuda_count=0, nccl=False, interfaces=set())
        ['the launch environment is invalid: RANK is set but WORLD_SIZE is not']
    """
    from .utils._env import missing_rendezvous_message

    traps = []
    if launch_error:
        traps.append(f"the launch environment is invalid: {launch_error}")
    if launch is not None and launch.is_distributed and (launch.master_addr is None or launch.master_port is None):
        traps.append(missing_rendezvous_message(launch))
    # The port a rendezvous server on this machine is about to listen on. Under
    # torchrun the agent already listens there (by design), and ranks other
    # than 0 do not listen at all.
    port, source = None, ""
    if launch is None or launch.launcher == "none":
        if environ.get("MASTER_PORT", "").strip().isdigit():
            port, source = int(environ["MASTER_PORT"]), "MASTER_PORT"
        elif "MASTER_PORT" not in environ:
            port, source = TORCHRUN_DEFAULT_PORT, "torchrun's default port"
    elif not launch.uses_agent_store and launch.rank == 0 and launch.master_port is not None \
            and _is_local(launch.master_addr):
        port = launch.master_port
        source = ("MASTER_PORT" if "MASTER_PORT" in environ
                  else f"the port nn_handler derives for this {launch.launcher} job")
    if port is not None and 0 < port < 65536 and port_in_use(port):
        remedy = ("pass torchrun --master_port=<a free port> (or --standalone), or export MASTER_PORT"
                  if source.startswith("torchrun") else "choose another one (nn_handler.find_free_port() gives one)")
        traps.append(f"{source} {port} is already in use on this machine, so a rendezvous server cannot listen "
                     f"there (torch reports EADDRINUSE); {remedy}")
    if cuda_initialized:
        traps.append("CUDA is already initialised in this process: processes forked from it cannot use CUDA, and "
                     "CUDA_VISIBLE_DEVICES changes made now have no effect; start workers before touching CUDA "
                     "(nn_handler's executors never fork this process and are not affected)")
    if cuda_count and not nccl:
        traps.append(f"{cuda_count} CUDA device{'s' if cuda_count != 1 else ''} but torch has no nccl backend: "
                     f"multi-GPU process groups fall back to gloo, which is much slower on GPUs")
    traps += _interface_traps(environ, _interfaces() if interfaces is None else interfaces)
    if shm_bytes is not None and shm_bytes < SMALL_SHM_BYTES:
        traps.append(f"/dev/shm holds only {shm_bytes / 2**20:.0f} MiB: large tensors sent to and from workers "
                     f"(and DataLoader workers) go through it; in Docker, start the container with --shm-size=8g "
                     f"or --ipc=host")
    return traps


def collect_info(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Everything ``info`` prints, as plain data (what ``info --json`` prints).

    Args:
        environ: The environment to read; ``os.environ`` when omitted.

    Returns:
        A dict with ``versions``, ``extras`` (optional packages' versions),
        ``threads``, ``settings`` (``NN_HANDLER_*``), ``platform``, ``cuda``, ``backends``,
        ``launch``, ``ray``, ``workers`` and ``warnings``. ``launch`` is the detected
        :class:`~nn_handler.utils._env.LaunchEnv` as a dict (plus
        ``slurm_job_without_srun``: job id and tasks, for a plain process in a
        SLURM allocation of several tasks), or ``{"error": why}`` when the
        launch variables are wrong.
    """
    import multiprocessing

    import torch

    from . import __version__
    from .errors import LaunchEnvironmentError
    from .utils._env import detect_launch_env, slurm_job_without_srun, slurm_job_without_srun_message

    environ = os.environ if environ is None else environ
    # Read before anything below can initialise CUDA itself.
    cuda_initialized = torch.cuda.is_initialized()
    launch, launch_error = None, None
    try:
        launch = detect_launch_env(environ)
    except LaunchEnvironmentError as exc:
        launch_error = str(exc)
    cuda = _sysinfo.cuda_report()
    backends = _sysinfo.backends()
    shm = _sysinfo.shm_bytes()
    traps = find_traps(environ, launch, launch_error, cuda_initialized=cuda_initialized,
                       cuda_count=len(cuda["devices"]), nccl=backends["nccl"], shm_bytes=shm)
    launch_info: dict[str, Any] = dataclasses.asdict(launch) if launch is not None else {"error": launch_error}
    alone = slurm_job_without_srun(environ) if launch is not None else None
    if alone is not None:
        job_id, tasks = alone
        launch_info["slurm_job_without_srun"] = {"job_id": job_id, "tasks": tasks}
        traps.insert(0, slurm_job_without_srun_message(job_id, tasks))
    methods = multiprocessing.get_all_start_methods()
    return {
        "versions": {
            "nn_handler": __version__,
            "python": platform.python_version(),
            "torch": str(torch.__version__),
            "cloudpickle": _sysinfo.version("cloudpickle"),
            "numpy": _sysinfo.version("numpy"),
        },
        "extras": _sysinfo.extras(),
        "threads": _sysinfo.threads(environ),
        "settings": _sysinfo.settings(environ),
        "platform": {"system": platform.platform(), "executable": sys.executable, "hostname": socket.gethostname(),
                     "cpus": _sysinfo.cpu_count()},
        "cuda": cuda,
        "backends": backends,
        "launch": launch_info,
        "ray": _sysinfo.ray_report(environ),
        "workers": {"start_method": "forkserver" if "forkserver" in methods else "spawn",
                    "shm_gib": None if shm is None else round(shm / 2**30, 2)},
        "warnings": traps,
    }


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def format_info(info: Mapping[str, Any]) -> str:
    """The human-readable ``info`` report."""
    v, cuda, launch = info["versions"], info["cuda"], info["launch"]
    lines = [f"nn_handler {v['nn_handler']}"]
    for name in ("python", "torch", "cloudpickle", "numpy"):
        lines.append(f"  {name:<12} {v[name] or 'not installed'}")
    lines += _sysinfo.format_more(info) if "extras" in info else []  # (absent from older reports)
    p = info["platform"]
    lines.append(f"platform       {p['system']} on {p['hostname']}, {p['cpus']} CPU cores available")
    if cuda["available"]:
        lines.append(f"CUDA           {len(cuda['devices'])} device(s), CUDA {cuda['build']}")
        for d in cuda["devices"]:
            lines.append(f"  cuda:{d['index']}  {d['name']}  {d['total_memory_gib']:.1f} GiB  "
                         f"compute capability {d['capability']}")
    else:
        why = ("torch is a CPU-only build" if cuda["build"] is None
               else f"torch built for CUDA {cuda['build']}, no device visible")
        lines.append(f"CUDA           not available ({why})")
    b = info["backends"]
    lines.append(f"backends       nccl: {_yes(b['nccl'])}  gloo: {_yes(b['gloo'])}  mpi: {_yes(b['mpi'])}")
    if "error" in launch:
        lines.append(f"launch         invalid: {launch['error']}")
    elif launch["launcher"] == "none":
        alone = launch.get("slurm_job_without_srun")
        where = (f" in SLURM job {alone['job_id']} with {alone['tasks']} tasks, not started by srun" if alone
                 else "")
        lines.append(f"launch         none: a plain process (rank 0 of 1){where}")
    else:
        master = (f"{launch['master_addr']}:{launch['master_port']}"
                  if launch["master_addr"] is not None and launch["master_port"] is not None else "unknown")
        lines.append(f"launch         {launch['launcher']}: rank {launch['rank']} of {launch['world_size']}, "
                     f"local rank {launch['local_rank']}, master {master}")
    if "ray" in info:  # absent from reports made before it was added
        lines.append(_sysinfo.format_ray(info["ray"]))
    w = info["workers"]
    shm = "absent" if w["shm_gib"] is None else f"{w['shm_gib']:.1f} GiB"
    lines.append(f"workers        started by {w['start_method']}; /dev/shm {shm}")
    if info["warnings"]:
        lines.append("warnings")
        lines += [f"  - {text}" for text in info["warnings"]]
    else:
        lines.append("warnings       none")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- check
@dataclasses.dataclass(frozen=True, slots=True)
class CheckResult:
    """The outcome of one self-test step.

    Attributes:
        name: What was checked.
        ok: Whether it passed; ``None`` when it was skipped (an earlier step failed).
        seconds: How long it took.
        detail: What was seen, or the error.
    """

    name: str
    ok: bool | None
    seconds: float
    detail: str


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _matmul_probe(n: int, device) -> tuple[str, int, float]:
    import torch

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen)
    value = float((a.to(device) @ a.to(device)).sum().cpu())
    return str(device), os.getpid(), value


def check_executor(devices: list[str], timeout: float) -> list[CheckResult]:
    """Start a :class:`~nn_handler.ParallelExecutor` on ``devices`` and run one small matmul on each."""
    import torch

    from .utils.ddp_decorators import ParallelExecutor

    start = time.perf_counter()
    try:
        with ParallelExecutor(device_ids=devices, timeout=timeout) as ex:
            results = ex.run(_matmul_probe, 64)
    except Exception as exc:
        return [CheckResult("executor", False, time.perf_counter() - start, _first_line(exc))]
    seconds = time.perf_counter() - start
    expected = _matmul_probe(64, torch.device("cpu"))[2]
    bad = [d for d, _, value in results if abs(value - expected) > 1e-3 * max(1.0, abs(expected))]
    pids = {pid for _, pid, _ in results}
    if bad or len(pids) != len(devices):
        why = f"wrong result on {', '.join(bad)}" if bad else "workers share a process"
        return [CheckResult("executor", False, seconds, why)]
    return [CheckResult("executor", True, seconds,
                        f"{len(devices)} worker{'s' if len(devices) != 1 else ''} on {', '.join(devices)}")]


def _group_probe(rank: int, with_ddp: bool, backend: str) -> dict[str, Any]:
    """One rank of the group check: an all-reduce, then one DDP step, each timed."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from .utils.ddp import resolve_device

    if not dist.is_initialized():
        # initialize_ddp (called by run_ranks) forms no group for a world
        # of one; a one-rank group still tests the backend, so form it here.
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=1)
    world = dist.get_world_size()
    backend = dist.get_backend()
    device = resolve_device("cuda") if backend == "nccl" else torch.device("cpu")
    out: dict[str, Any] = {"device": str(device)}
    start = time.perf_counter()
    t = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(t)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out["allreduce_s"] = time.perf_counter() - start
    out["sum"] = float(t.item())
    if not with_ddp:
        return out

    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    model = torch.nn.Linear(8, 1).to(device)
    local = torch.nn.Linear(8, 1).to(device)
    local.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    x = torch.full((4, 8), float(rank + 1), device=device)
    start = time.perf_counter()
    ddp(x).sum().backward()
    torch.optim.SGD(ddp.parameters(), lr=0.1).step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out["ddp_s"] = time.perf_counter() - start
    # What DDP must have done: averaged every rank's local gradient.
    local(x).sum().backward()
    grads = local.weight.grad.detach().clone()
    dist.all_reduce(grads)
    out["grad_ok"] = bool(torch.allclose(model.weight.grad, grads / world, rtol=1e-4, atol=1e-5))
    weights = model.weight.detach().clone()
    first = weights.clone()
    dist.broadcast(first, src=0)
    out["in_sync"] = bool(torch.equal(weights, first))
    return out


def check_group(nprocs: int, backend: str, timeout: float, with_ddp: bool,
                hide_gpus: bool = False) -> list[CheckResult]:
    """Form a ``backend`` group of ``nprocs`` local processes; all-reduce, and one DDP step if ``with_ddp``."""
    from .errors import DistributedTimeoutError
    from .utils._workers.launch import run_ranks

    names = [f"process group ({backend})", f"all-reduce ({backend})"] + ([f"DDP step ({backend})"] if with_ddp else [])
    start = time.perf_counter()
    try:
        # A rank stuck connecting to a store whose host rank already failed
        # retries until the group's timeout: keep that well inside ours.
        rows = run_ranks(_group_probe, nprocs, args=(with_ddp, backend), timeout=timeout, backend=backend,
                         pg_timeout=min(30.0, timeout / 2),
                         env={"CUDA_VISIBLE_DEVICES": ""} if hide_gpus else None)
    except DistributedTimeoutError as exc:
        # The ranks that did finish usually hold the cause (the others waited for them).
        rows = [exc if r in exc.unfinished else row for r, row in enumerate(exc.results)]
    except Exception as exc:
        rows = [exc]
    total = time.perf_counter() - start
    errors = [(r, row) for r, row in enumerate(rows) if isinstance(row, BaseException)]
    if errors:
        rank, exc = min(errors, key=lambda e: isinstance(e[1], DistributedTimeoutError))
        where = "" if len(rows) == 1 else f"rank {rank}: "
        return [CheckResult(names[0], False, total, where + _first_line(exc))] + [
            CheckResult(n, None, 0.0, "skipped") for n in names[1:]]
    body = max(row["allreduce_s"] + row.get("ddp_s", 0.0) for row in rows)
    results = [CheckResult(names[0], True, total - body,
                           f"{nprocs} rank{'s' if nprocs != 1 else ''} on 127.0.0.1, "
                           f"devices {', '.join(row['device'] for row in rows)}")]
    expected = nprocs * (nprocs + 1) / 2
    sums = {row["sum"] for row in rows}
    results.append(CheckResult(names[1], sums == {expected}, max(row["allreduce_s"] for row in rows),
                               f"sum of 1..{nprocs} = {sorted(sums)[0]:g} on every rank" if sums == {expected}
                               else f"expected {expected:g} on every rank, got {[row['sum'] for row in rows]}"))
    if with_ddp:
        ok = all(row["grad_ok"] and row["in_sync"] for row in rows)
        detail = ("gradients averaged over every rank, weights equal after the step" if ok else
                  f"gradients averaged: {[row['grad_ok'] for row in rows]}, "
                  f"weights in sync: {[row['in_sync'] for row in rows]}")
        results.append(CheckResult(names[2], ok, max(row["ddp_s"] for row in rows), detail))
    return results


def plan_checks(nprocs: int | None, timeout: float, cuda_count: int,
                nccl: bool) -> tuple[str, list[Callable[[], list[CheckResult]]]]:
    """What ``check`` runs on this machine: a headline, and the steps.

    With GPUs: an executor with one worker per GPU, a gloo all-reduce, and an
    all-reduce and DDP step in an nccl group (one rank per GPU). Without: as
    many CPU workers and gloo ranks as ``nprocs`` (2 by default), with the DDP
    step on gloo.
    """
    if cuda_count:
        n = min(nprocs or cuda_count, cuda_count)
        devices = [f"cuda:{i}" for i in range(n)]
        headline = f"{n} of {cuda_count} CUDA device{'s' if cuda_count != 1 else ''}"
        # The gloo group runs on the CPU with the GPUs hidden, so it may have
        # more ranks than there are GPUs (initialize_ddp pins each rank to one).
        steps = [lambda: check_executor(devices, timeout),
                 lambda: check_group(nprocs or 2, "gloo", timeout, with_ddp=not nccl, hide_gpus=True)]
        if nccl:
            steps.append(lambda: check_group(n, "nccl", timeout, with_ddp=True))
        return headline, steps
    n = nprocs or 2
    headline = f"{n} CPU worker{'s' if n != 1 else ''} (no CUDA device)"
    return headline, [lambda: check_executor(["cpu"] * n, timeout),
                      lambda: check_group(n, "gloo", timeout, with_ddp=True)]


def run_checks(steps: list[Callable[[], list[CheckResult]]], out: TextIO) -> int:
    """Run the steps in order, print one line per result, and return the exit status (0: all passed).

    A step that raises counts as failed; a step never stops the ones after it.

    Example:
        >>> import io
        >>> buf = io.StringIO()
        >>> run_checks([lambda: [CheckResult("demo", True, 0.5, "fine")]], buf)
        0
        >>> print(buf.getvalue().splitlines()[0])
          PASS  demo                   0.50 s  fine
    """
    results: list[CheckResult] = []
    start = time.perf_counter()
    for step in steps:
        t = time.perf_counter()
        try:
            found = step()
        except Exception as exc:  # a bug in a step must still be reported as a failure, with the rest run
            found = [CheckResult("check step", False, time.perf_counter() - t, _first_line(exc))]
        for r in found:
            label = {True: "PASS", False: "FAIL", None: "SKIP"}[r.ok]
            print(f"  {label}  {r.name:<20} {r.seconds:6.2f} s  {r.detail}", file=out, flush=True)
        results.extend(found)
    failed = [r for r in results if r.ok is False]
    elapsed = time.perf_counter() - start
    if failed:
        print(f"{len(failed)} of {len(results)} checks FAILED ({elapsed:.1f} s); "
              f"`python -m nn_handler info` lists known traps", file=out)
        return 1
    print(f"all {len(results)} checks passed in {elapsed:.1f} s", file=out)
    return 0


# ----------------------------------------------------------------------------- entry point
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m nn_handler`` argument parser (unknown commands and options exit with status 2)."""
    parser = argparse.ArgumentParser(
        prog="python -m nn_handler",
        description="nn_handler environment report and self-test.",
        epilog="Run `python -m nn_handler check` first on a new machine or cluster node.",
    )
    commands = parser.add_subparsers(dest="command", metavar="{info,check}", required=True)
    info = commands.add_parser("info", help="versions, CUDA devices, backends, launch environment, known traps",
                               description="Report versions, CUDA devices, distributed backends, the detected "
                                           "launch environment and warnings for known traps.")
    info.add_argument("--json", action="store_true", help="print the report as JSON")
    check = commands.add_parser("check", help="self-test: worker pool, all-reduce, one DDP step",
                                description="Start a ParallelExecutor on every device, run an all-reduce in a "
                                            "small process group and one DDP step; exit 1 if any step fails.")
    check.add_argument("--nprocs", type=_positive_int, default=None, metavar="N",
                       help="workers and ranks to start (default: every GPU, or 2 CPU processes without GPUs)")
    check.add_argument("--timeout", type=_positive_float, default=120.0, metavar="S",
                       help="seconds each step may take before it fails (default: 120)")
    return parser


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    """Run ``python -m nn_handler`` with ``argv``; returns the exit status.

    ``info`` returns 1 when the launch variables are wrong (the report says
    which), 0 otherwise; ``check`` returns 1 when a step fails.

    Raises:
        SystemExit: With status 2 for an unknown command or option (argparse).
    """
    out = sys.stdout if out is None else out
    args = build_parser().parse_args(argv)
    if args.command == "info":
        info = collect_info()
        if _sysinfo.speaks_for_node(info["launch"]):  # under torchrun: one report per node, not per rank
            print(json.dumps(info, indent=2) if args.json else format_info(info), file=out)
        # A wrong launch environment fails initialize_ddp in any script run
        # here, so a preflight `python -m nn_handler info && ...` stops too.
        # Warnings (traps) are advice and leave the status at 0.
        return 1 if "error" in info["launch"] else 0
    info = collect_info()
    headline, steps = plan_checks(args.nprocs, args.timeout, len(info["cuda"]["devices"]), info["backends"]["nccl"])
    print(f"nn_handler check: {headline}", file=out, flush=True)
    for text in info["warnings"]:  # a known trap often explains the failure below
        print(f"  warning: {text}", file=out, flush=True)
    return run_checks(steps, out)

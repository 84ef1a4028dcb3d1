"""What ``python -m nn_handler info`` reads: versions, extras, threads, settings, CUDA, backends, memory, Ray.

Plain probes that start nothing: Ray is looked up in the installed packages,
never imported, and the cluster it would join is read from ``RAY_ADDRESS``.
"""

from __future__ import annotations

import os
from typing import Any, Mapping


def version(module_name: str) -> str | None:
    try:
        module = __import__(module_name)
    except ImportError:
        return None
    return str(getattr(module, "__version__", "unknown"))


def cuda_report() -> dict[str, Any]:
    import torch

    report: dict[str, Any] = {"available": False, "build": torch.version.cuda, "devices": []}
    if not torch.cuda.is_available():
        return report
    report["available"] = True
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        report["devices"].append({
            "index": i,
            "name": props.name,
            "total_memory_gib": round(props.total_memory / 2**30, 2),
            "capability": f"{props.major}.{props.minor}",
        })
    return report


def backends() -> dict[str, bool]:
    import torch.distributed as dist

    if not dist.is_available():
        return {"nccl": False, "gloo": False, "mpi": False}
    return {"nccl": dist.is_nccl_available(), "gloo": dist.is_gloo_available(), "mpi": dist.is_mpi_available()}


def shm_bytes() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def ray_report(environ: Mapping[str, str]) -> dict[str, Any]:
    """Whether Ray is installed (its version) and the cluster ``backend="ray"`` would join, without importing it.

    Example:
        >>> ray_report({"RAY_ADDRESS": "ray://head:10001"})["address"]
        'ray://head:10001'
    """
    from importlib import metadata

    try:
        installed = metadata.version("ray")
    except metadata.PackageNotFoundError:
        installed = None
    return {"version": installed, "address": environ.get("RAY_ADDRESS") or None}


def format_ray(ray: Mapping[str, Any]) -> str:
    """The ``ray`` line of the report.

    Example:
        >>> format_ray({"version": None, "address": None})
        "ray            not installed (backend='ray' needs pip install 'nn_handler[ray]')"
    """
    if ray["version"] is None:
        return "ray            not installed (backend='ray' needs pip install 'nn_handler[ray]')"
    where = (f"joins the cluster at RAY_ADDRESS={ray['address']}" if ray["address"]
             else "no RAY_ADDRESS: backend='ray' joins the Ray this process started, else starts a local one")
    return f"ray            {ray['version']}; {where}"


# The optional packages a bug report needs the versions of (what the extras bring, and what the library uses
# when present); read from the installed distributions, none imported (Ray's import alone takes seconds).
EXTRAS = ("numpy", "tqdm", "matplotlib", "tensorboard", "ray", "transformers", "nvidia-ml-py")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def extras() -> dict[str, str | None]:
    """The installed version of each of :data:`EXTRAS`, ``None`` when absent (nothing is imported)."""
    from importlib import metadata

    found: dict[str, str | None] = {}
    for name in EXTRAS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def threads(environ: Mapping[str, str]) -> dict[str, Any]:
    """torch's intra-op and inter-op thread counts and the variables that set them (``None``: unset)."""
    import torch

    report: dict[str, Any] = {"torch": torch.get_num_threads(), "interop": torch.get_num_interop_threads()}
    report.update({name: environ.get(name) for name in THREAD_VARIABLES})
    return report


def settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``NN_HANDLER_*`` variables in effect.

    Example:
        >>> settings({"NN_HANDLER_STALL_TIMEOUT": "60", "PATH": "/bin"})
        {'NN_HANDLER_STALL_TIMEOUT': '60'}
    """
    return {name: environ[name] for name in sorted(environ) if name.startswith("NN_HANDLER_")}


def speaks_for_node(launch: Mapping[str, Any]) -> bool:
    """Whether this process prints the report of its node: all but local rank 0 stay quiet where a launcher
    started several ranks on it (``torchrun -m nn_handler info`` prints one report per node, not per rank).

    Example:
        >>> speaks_for_node({"local_rank": 1, "local_world_size": 2}), speaks_for_node({"local_rank": 0})
        (False, True)
    """
    return "error" in launch or not launch.get("local_world_size") or launch.get("local_rank", 0) == 0


def format_more(info: Mapping[str, Any]) -> list[str]:
    """The lines of ``extras``, ``threads`` and ``settings`` in the report.

    Example:
        >>> info = {"extras": {"tqdm": "4.67.1", "ray": None},
        ...         "threads": {"torch": 4, "interop": 4, "OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": None},
        ...         "settings": {}}
        >>> print("\\n".join(format_more(info)))
        extras         tqdm 4.67.1; not installed: ray
        threads        torch 4, interop 4; OMP_NUM_THREADS=4, MKL_NUM_THREADS unset
        NN_HANDLER_*   none set
    """
    present = [f"{name} {version}" for name, version in info["extras"].items() if version]
    absent = [name for name, version in info["extras"].items() if not version]
    parts = [", ".join(present)] if present else []
    parts += ["not installed: " + ", ".join(absent)] if absent else []
    lines = ["extras         " + "; ".join(parts)]
    t = info["threads"]
    variables = ", ".join(f"{name}={t[name]}" if t[name] is not None else f"{name} unset" for name in THREAD_VARIABLES)
    lines.append(f"threads        torch {t['torch']}, interop {t['interop']}; {variables}")
    s = info["settings"]
    lines.append("NN_HANDLER_*   " + (", ".join(f"{k}={v}" for k, v in s.items()) if s else "none set"))
    return lines

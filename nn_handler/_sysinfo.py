"""What ``python -m nn_handler info`` reads about this machine: versions, CUDA, backends, memory, Ray.

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

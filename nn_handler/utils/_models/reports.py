"""Device, memory and data-parallel reports, re-exported by :mod:`nn_handler.utils.parallel`."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..._checks import check_int
from .._devices import cuda_count
from ..ddp import get_rank, get_world_size, is_distributed

__all__ = [
    "get_device_count",
    "is_parallel_available",
    "get_gpu_memory_info",
    "print_gpu_memory_info",
    "get_gpu_stats",
    "get_recommended_batch_size",
]

log = logging.getLogger(__name__)



def get_device_count() -> int:
    """Number of CUDA devices this process can use; 0 without CUDA.

    Example:
        >>> get_device_count() >= 0
        True
    """
    return cuda_count()


def is_parallel_available() -> bool:
    """True when two or more CUDA devices are available.

    Example:
        >>> is_parallel_available() == (get_device_count() > 1)
        True
    """
    return get_device_count() > 1


def get_recommended_batch_size(base_batch_size: int = 1, scale_with_gpus: bool = True) -> int:
    """A batch size for this process: ``base_batch_size`` times the GPU count under ``DataParallel``.

    ``DataParallel`` splits each batch over all local GPUs, so the batch grows
    with them. Under DDP every process already feeds its own GPU, so the
    per-process batch stays ``base_batch_size``; without GPUs it is
    ``base_batch_size`` too.

    Args:
        base_batch_size: The batch size for one GPU; >= 1.
        scale_with_gpus: Multiply by the number of GPUs (when not distributed).

    Returns:
        The recommended batch size.

    Raises:
        ConfigurationError: ``base_batch_size`` below 1.

    Example:
        >>> get_recommended_batch_size(8, scale_with_gpus=False)
        8
        >>> get_recommended_batch_size(8) == 8 * max(1, get_device_count())
        True
    """
    check_int("base_batch_size", base_batch_size, minimum=1)
    if not scale_with_gpus or is_distributed():
        return base_batch_size
    return base_batch_size * max(1, get_device_count())


def get_gpu_memory_info() -> list[dict[str, Any]]:
    """Memory of every CUDA device, as this process's allocator sees it; ``[]`` without CUDA.

    Returns:
        One dict per device with ``device_id``, ``name``, ``total_memory``,
        ``allocated`` (bytes held by tensors) and ``cached`` (bytes reserved by
        the caching allocator), all in bytes.

    Example:
        >>> all(info["allocated"] <= info["total_memory"] for info in get_gpu_memory_info())
        True
    """
    infos = []
    for i in range(get_device_count()):
        infos.append({
            "device_id": i,
            "name": torch.cuda.get_device_name(i),
            "total_memory": int(torch.cuda.get_device_properties(i).total_memory),
            "allocated": int(torch.cuda.memory_allocated(i)),
            "cached": int(torch.cuda.memory_reserved(i)),
        })
    return infos


def print_gpu_memory_info() -> None:
    """Print one line per CUDA device: allocated / total and cached memory, in GiB.

    A line reads ``GPU 0 (NVIDIA A100-SXM4-40GB): 12.50 GiB / 39.59 GiB
    (allocated), 15.20 GiB (cached)``; without CUDA the one line is ``No CUDA
    devices available``.

    Example:
        >>> import contextlib, io
        >>> out = io.StringIO()
        >>> with contextlib.redirect_stdout(out):
        ...     print_gpu_memory_info()
        >>> len(out.getvalue().splitlines()) == max(1, get_device_count())
        True
    """
    infos = get_gpu_memory_info()
    if not infos:
        print("No CUDA devices available")
        return
    gib = 1024**3
    for info in infos:
        print(f"GPU {info['device_id']} ({info['name']}): {info['allocated'] / gib:.2f} GiB / "
              f"{info['total_memory'] / gib:.2f} GiB (allocated), {info['cached'] / gib:.2f} GiB (cached)")


def _nvml_utilization(count: int) -> list[int | None]:
    """GPU utilisation in percent per CUDA index, ``None`` where NVML cannot tell."""
    try:
        import pynvml  # from the optional nvidia-ml-py package: pip install 'nn_handler[gpu]'
    except ImportError:
        log.debug("GPU utilisation unknown: nvidia-ml-py is not installed (pip install 'nn_handler[gpu]')")
        return [None] * count
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # no driver, no permission: utilisation is simply unknown
        log.debug("NVML unavailable: %s", exc)
        return [None] * count
    found: list[int | None] = []
    try:
        for i in range(count):
            try:
                found.append(int(pynvml.nvmlDeviceGetUtilizationRates(_nvml_handle(pynvml, i)).gpu))
            except Exception as exc:
                log.debug("NVML utilisation of cuda:%d unavailable: %s", i, exc)
                found.append(None)
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return found


def _nvml_handle(pynvml, index: int):
    # NVML numbers GPUs in PCI order and ignores CUDA_VISIBLE_DEVICES; CUDA's
    # index does neither. Only the UUID names the same device in both, so
    # without one the utilisation is left unknown rather than guessed.
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is None:
        raise LookupError(f"torch reports no UUID for cuda:{index}")
    text = str(uuid)
    return pynvml.nvmlDeviceGetHandleByUUID(text if text.startswith("GPU-") else f"GPU-{text}")


def get_gpu_stats() -> dict[str, Any]:
    """A snapshot of this process's parallel setup and of every GPU's memory (and utilisation).

    Returns:
        ``device_count``, ``distributed`` (a process group exists), ``rank``,
        ``world_size`` and ``gpu_memory``: one dict per CUDA device with
        ``device``, ``name``, ``total_mb``, ``allocated_mb``, ``reserved_mb``
        and ``free_mb`` (total minus what this process reserved), plus
        ``utilization`` (percent) when the optional ``nvidia-ml-py`` package is
        installed (``pip install 'nn_handler[gpu]'``) and NVML answers;
        otherwise that key is absent.

    Example:
        >>> stats = get_gpu_stats()
        >>> stats["device_count"] == len(stats["gpu_memory"])
        True
    """
    infos = get_gpu_memory_info()
    mib = 1024**2
    utilization = _nvml_utilization(len(infos)) if infos else []
    per_gpu = []
    for info, util in zip(infos, utilization):
        entry = {
            "device": info["device_id"],
            "name": info["name"],
            "total_mb": info["total_memory"] / mib,
            "allocated_mb": info["allocated"] / mib,
            "reserved_mb": info["cached"] / mib,
            "free_mb": (info["total_memory"] - info["cached"]) / mib,
        }
        if util is not None:
            entry["utilization"] = util
        per_gpu.append(entry)
    return {
        "device_count": len(infos),
        "distributed": is_distributed(),
        "rank": get_rank(),
        "world_size": get_world_size(),
        "gpu_memory": per_gpu,
    }

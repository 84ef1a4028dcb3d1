"""A user's script, type-checked (never run) by tests/launch/test_typing.py against the installed package.

Each line that mypy must report ends with ``# error: [code, ...]``; every
other line must pass.
"""

import torch

from nn_handler import ParallelExecutor, on_rank, parallelize_on_gpus


@parallelize_on_gpus(device_ids=["cpu", "cpu"])
def scale(device: torch.device, x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
    return x.to(device) * factor


@parallelize_on_gpus
def norm(device: torch.device, x: torch.Tensor) -> float:
    return float(x.to(device).norm())


@parallelize_on_gpus(2, False)
def plain(x: int) -> str:
    return str(x)


@parallelize_on_gpus(pass_device=False)
def plain_too(x: int) -> str:
    return str(x)


@parallelize_on_gpus()
def by_keyword(x: int, *, device: torch.device) -> bytes:  # the device elsewhere: its result type is kept
    return bytes(x)


@on_rank(0)
def save(path: str) -> int:
    return len(path)


@on_rank([0, 1], broadcast_result=True)
def latest(path: str) -> str:
    return path


def count(device: torch.device, n: int) -> int:
    return n


# Correct calls: the device is not passed, results are lists of the function's result.
tensors: list[torch.Tensor] = scale(torch.ones(2))
tensors = scale(torch.ones(2), factor=3.0)
norms: list[float] = norm(torch.ones(2))
texts: list[str] = plain(3) + plain_too(4)
blobs: list[bytes] = by_keyword(3)
saved: int | None = save("model.pt")
path: str = latest("ckpt")
scale.shutdown()
with ParallelExecutor(device_ids=["cpu"]) as ex:
    counts: list[int] = ex.run(count, 3)
    one: int = ex.submit(count, 3).result()
    many: list[int] = list(ex.map(count, [1, 2]))

# Wrong calls.
scale()  # error: [call-arg]
scale("not a tensor")  # error: [arg-type]
scale(torch.device("cpu"), torch.ones(2))  # error: [arg-type]
wrong_norms: list[int] = norm(torch.ones(2))  # error: [assignment]
wrong_blobs: list[str] = by_keyword(3)  # error: [assignment]
plain(torch.device("cpu"), 3)  # error: [call-arg, arg-type]
save(3)  # error: [arg-type]
sure: int = save("model.pt")  # error: [assignment]
wrong_counts: list[str] = ex.run(count, 3)  # error: [arg-type]
wrong_one: str = ex.submit(count, 3).result()  # error: [assignment]

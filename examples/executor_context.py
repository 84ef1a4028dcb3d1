"""The seed's ``ParallelExecutor`` context-manager example, plus an initializer and ``map``.

    python examples/executor_context.py

A ``ParallelExecutor`` keeps one worker process per device warm for as long
as the ``with`` block lasts: ``run`` calls a function on every device,
``map`` spreads items over the devices, and an ``initializer`` prepares each
worker once (here: a model per device).
"""

import time

import torch

from nn_handler import ParallelExecutionError, ParallelExecutor, worker_state

DEVICES = None if torch.cuda.is_available() else ["cpu", "cpu"]


def heavy_computation(device, data):
    # Move data to the specified device and compute there.
    data = data.to(device)
    return data * 2


def load_model(seed, device):
    """Runs once in each worker when it starts: build that worker's model on its device."""
    # worker_state() is a dict owned by this worker process. Functions defined
    # in a script or notebook travel by value with their own copy of the
    # globals, so a global assigned here would not be seen by later calls.
    torch.manual_seed(seed)
    worker_state()["model"] = torch.nn.Linear(4, 1).to(device).eval()


def predict(batch, device):
    with torch.no_grad():
        return worker_state()["model"](batch.to(device)).cpu()


def fails_on_odd(x, device):
    if x % 2:
        raise ValueError(f"odd input {x}")
    return x


def main():
    data = torch.tensor([1, 2, 3])
    start = time.perf_counter()
    with ParallelExecutor(device_ids=DEVICES) as executor:
        results = executor.run(heavy_computation, data)
        print(f"run on {executor.devices}: {[r.tolist() for r in results]}")

    with ParallelExecutor(device_ids=DEVICES, initializer=load_model, initargs=(0,)) as executor:
        batches = list(torch.randn(8, 4).split(2))
        outputs = list(executor.map(predict, batches))  # each batch goes to whichever worker is free
        print(f"map: {len(outputs)} batches through one model per worker, first output {outputs[0].flatten().tolist()}")
        try:
            list(executor.map(fails_on_odd, range(4)))
        except ValueError as exc:  # the task's own exception, also a ParallelExecutionError
            where = exc.__notes__[-1].splitlines()[0]  # the note names the worker; exc.__cause__ is its traceback
            print(f"a failing task raises here as itself (a ParallelExecutionError too: "
                  f"{isinstance(exc, ParallelExecutionError)}): {where}")
        print(f"the pool is still usable: {list(executor.map(fails_on_odd, [0, 2]))}")
    print(f"done in {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()

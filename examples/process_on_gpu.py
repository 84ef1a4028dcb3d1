"""The seed's ``@parallelize_on_gpus`` example, runnable without a GPU.

    python examples/process_on_gpu.py

The decorated function runs once per device, in a worker process of its own,
and the call returns one result per device. Without CUDA, two CPU worker
processes stand in for two GPUs.
"""

import torch

from nn_handler import parallelize_on_gpus

# Every GPU, or two CPU worker processes standing in for them.
DEVICES = None if torch.cuda.is_available() else ["cpu", "cpu"]


@parallelize_on_gpus(device_ids=DEVICES)
def process_on_gpu(device, data):
    # Runs on each device; results come back to the caller on the CPU.
    return data.to(device) * 2


@parallelize_on_gpus(device_ids=[0, 1] if torch.cuda.device_count() >= 2 else ["cpu", "cpu"])
def another_gpu_function(device, x, y):
    # The seed asks for num_gpus=2: the first two GPUs, or two CPU workers here.
    return (x + y).to(device)


def main():
    data = torch.tensor([1, 2, 3])
    results = process_on_gpu(data)
    print(f"process_on_gpu: {len(results)} results, one per device: {[r.tolist() for r in results]}")

    results = another_gpu_function(torch.tensor([1, 2]), torch.tensor([3, 4]))
    print(f"another_gpu_function: {[r.tolist() for r in results]}")
    # Stop the warm worker pools now instead of after keep_alive idle seconds.
    process_on_gpu.shutdown()
    another_gpu_function.shutdown()


if __name__ == "__main__":
    main()

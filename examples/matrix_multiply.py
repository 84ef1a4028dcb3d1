"""The seed's ``matrix_multiply`` example: the same matmul loop on every device at once.

    python examples/matrix_multiply.py --size 2000 --iterations 20   # the seed's sizes
    python examples/matrix_multiply.py --size 128 --iterations 3     # quick, on CPU

Each device multiplies its own random matrices and returns the result as a CPU
tensor (the seed returned a NumPy array; ``.numpy()`` on the tensor gives one
where numpy is installed, which nn_handler does not need).
"""

import argparse
import time

import torch

from nn_handler import parallelize_on_gpus

DEVICES = None if torch.cuda.is_available() else ["cpu", "cpu"]


@parallelize_on_gpus(device_ids=DEVICES)
def matrix_multiply(device, size=1000, iterations=10):
    # Create random matrices on the specified device
    a = torch.randn(size, size, device=device) / size**0.5  # scaled so that repeated products stay finite
    b = torch.randn(size, size, device=device) / size**0.5
    start = time.perf_counter()
    for _ in range(iterations):
        a = torch.matmul(a, b)
    if a.is_cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    return a.cpu(), seconds


def main():
    parser = argparse.ArgumentParser(description="matrix_multiply on every device")
    parser.add_argument("--size", type=int, default=1000)
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args()

    start = time.perf_counter()
    results = matrix_multiply(size=args.size, iterations=args.iterations)
    print(f"Received {len(results)} results, one from each device")
    for i, (matrix, seconds) in enumerate(results):
        gflops = 2 * args.size**3 * args.iterations / seconds / 1e9
        print(f"  device {i}: {type(matrix).__name__} {tuple(matrix.shape)}, {seconds:.3f} s, {gflops:.1f} GFLOP/s")
    print(f"total {time.perf_counter() - start:.2f} s (including worker start-up)")
    matrix_multiply.shutdown()


if __name__ == "__main__":
    main()

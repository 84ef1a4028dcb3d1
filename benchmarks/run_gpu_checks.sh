#!/usr/bin/env bash
# One shot on a GPU machine: the `gpu`-marked tests, then benchmarks/bench_gpu.py (training race, then the
# CUDA results part when benchmarks/gpu_results.py exists).
#
#     bash benchmarks/run_gpu_checks.sh                 # tests, then the full benchmark
#     BENCH_ARGS="--part train --models lm --profile" bash benchmarks/run_gpu_checks.sh
#     SKIP_BENCH=1 bash benchmarks/run_gpu_checks.sh    # tests only
#
# The GPU machine has torch (with CUDA), Lightning Fabric and Accelerate, but not this package: it runs from
# this checkout through PYTHONPATH. Exits non-zero when the tests or the benchmark failed (both always run).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
status=0

"$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPUs", torch.cuda.device_count())'
echo "== gpu tests"
timeout "${TEST_TIMEOUT:-420}" "$PY" -m pytest -m gpu -q -p no:cacheprovider || status=$?
if [ -z "${SKIP_BENCH:-}" ]; then
    echo "== bench_gpu.py ${BENCH_ARGS:-}"
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
    timeout "${BENCH_TIMEOUT:-900}" "$PY" benchmarks/bench_gpu.py ${BENCH_ARGS:-} || status=$?
fi
exit "$status"

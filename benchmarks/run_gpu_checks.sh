#!/usr/bin/env bash
# One shot on a GPU machine: the `gpu`-marked tests, then benchmarks/bench_gpu.py (training race, then the
# CUDA results part when benchmarks/gpu_results.py exists).
#
#     bash benchmarks/run_gpu_checks.sh                 # tests, then the full benchmark with --profile
#     BENCH_ARGS="--part train --models lm --profile" bash benchmarks/run_gpu_checks.sh
#     SKIP_BENCH=1 bash benchmarks/run_gpu_checks.sh    # tests only
#
# The GPU machine has torch (with CUDA), Lightning Fabric and Accelerate, but not this package: it runs from
# this checkout through PYTHONPATH. Exits non-zero when the tests or the benchmark failed (both always run).
# The default timeouts (240 s, 330 s) fit one 10-minute call; TEST_TIMEOUT and BENCH_TIMEOUT change them.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
status=0

"$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPUs", torch.cuda.device_count())'
echo "== gpu tests"
timeout "${TEST_TIMEOUT:-240}" "$PY" -m pytest -m gpu -q -p no:cacheprovider || status=$?
if [ -z "${SKIP_BENCH:-}" ]; then
    echo "== bench_gpu.py ${BENCH_ARGS---profile}"
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
    timeout "${BENCH_TIMEOUT:-330}" "$PY" benchmarks/bench_gpu.py ${BENCH_ARGS---profile} || status=$?
fi
exit "$status"

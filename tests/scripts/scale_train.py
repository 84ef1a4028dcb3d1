"""The scaling case under a launcher, with faults injected on request; prints RESULT {json} per rank.

    torchrun --nproc_per_node=2 tests/scripts/scale_train.py [--ckpt DIR] [fault]
    srun -n2 python tests/scripts/scale_train.py --fail-on-rank0

Faults (steps count optimizer steps over the whole run; 3 per epoch on 2 ranks):
    --die-at N             rank 1 hard-exits after step N, on torchrun's first attempt only
    --sigterm-launcher-at N  rank 0 sends SIGTERM to its parent (the torchrun agent) after step N
    --scancel-at N         rank 0 asks SLURM to send SIGTERM to every task of its job after step N
    --raise-at N           rank 1 raises ValueError after step N
    --fail-on-rank0        after training, an @on_rank(0) export raises OSError
"""
import argparse
import json
import os
import subprocess

from torch.distributed.elastic.multiprocessing.errors import record

from scale_case import EPOCHS, AtStep, build, hard_exit_on_first_attempt, raise_value_error, sigterm_to, summary

from nn_handler import TrainingPreempted, on_rank
from nn_handler.utils.ddp import detect_launch_env


@on_rank(0)
def export(handler):
    raise OSError(f"could not upload the model after epoch {handler.epoch}")


def scancel_own_job(handler):
    """What a preempting job or ``scancel --signal=TERM`` does: SIGTERM to every task of this job."""
    subprocess.run(["scancel", "--signal=TERM", os.environ["SLURM_JOB_ID"]], check=True, timeout=30)


# @record: when this rank fails, torchrun's summary shows this exception and
# its traceback (written to torchrun's error file), not only an exit code.
@record
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt")
    parser.add_argument("--die-at", type=int)
    parser.add_argument("--sigterm-launcher-at", type=int)
    parser.add_argument("--scancel-at", type=int)
    parser.add_argument("--raise-at", type=int)
    parser.add_argument("--fail-on-rank0", action="store_true")
    args = parser.parse_args()
    callbacks = []
    if args.die_at:
        callbacks.append(AtStep(args.die_at, hard_exit_on_first_attempt, rank=1))
    if args.sigterm_launcher_at:
        callbacks.append(AtStep(args.sigterm_launcher_at, sigterm_to(os.getppid), rank=0))
    if args.scancel_at:
        callbacks.append(AtStep(args.scancel_at, scancel_own_job, rank=0))
    if args.raise_at:
        callbacks.append(AtStep(args.raise_at, raise_value_error, rank=1))
    with build(args.ckpt, resume="auto" if args.ckpt else None, callbacks=callbacks) as handler:
        try:
            handler.train(EPOCHS, progress=False)
        except TrainingPreempted as exc:
            print("RESULT " + json.dumps({"rank": handler.rank, "preempted": exc.code, "checkpoint": exc.checkpoint,
                                          "global_step": handler.global_step}), flush=True)
            raise
        row = summary(handler)
        row.update(launcher=detect_launch_env().launcher,
                   restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        print("RESULT " + json.dumps(row), flush=True)
        if args.fail_on_rank0:
            try:
                export(handler)
            except Exception as exc:
                print("RESULT " + json.dumps({"rank": handler.rank, "export_error": type(exc).__name__,
                                              "is_oserror": isinstance(exc, OSError),
                                              "first_line": str(exc).splitlines()[0]}), flush=True)
                raise


if __name__ == "__main__":
    main()

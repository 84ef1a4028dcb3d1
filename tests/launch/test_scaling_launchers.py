"""Past one machine, for real: torchrun nodes, elastic restarts, preemption, root causes, SLURM.

Every test launches real torchrun/srun/sbatch processes on CPU (gloo) with a
hard deadline, and kills what it started. The torchrun reference run (one
node, two processes, no checkpoints) is what every other way of running the
same training must reproduce: weights bit for bit, History exactly.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid

import pytest
import torch

from helpers import LAUNCH_VARS, REPO, parse_results, run_command
from nn_handler import PREEMPTED_EXIT_CODE
from nn_handler.checkpoint import list_run_checkpoints, load_payload
from nn_handler.utils.ddp import find_free_port

pytestmark = pytest.mark.slow

SCRIPT = "tests/scripts/scale_train.py"
EXAMPLE = "examples/slurm/train.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
RUN_S = 150  # one launch; far above the ~5-15 s it takes, below the tests' own limits
SUMMARY = ("world_size", "hash", "epoch", "global_step", "train_loss", "train_mae", "val_loss", "val_mae", "lr")


def _torchrun(*args: str, nproc: int = 2) -> list[str]:
    return [*TORCHRUN, f"--nproc_per_node={nproc}", f"--master_port={find_free_port()}", *args]


def _summaries(rows: list[dict]) -> list[dict]:
    return [{k: row[k] for k in ("rank", *SUMMARY)} for row in rows]


def _ok(result) -> list[dict]:
    assert result.returncode == 0, result.stdout[-4000:]
    return parse_results(result.stdout)


def _reference() -> list[dict]:
    """torchrun --nnodes=1 --nproc_per_node=2, no checkpoints, nothing injected."""
    rows = _ok(run_command(_torchrun(SCRIPT), timeout=RUN_S))
    assert [r["rank"] for r in rows] == [0, 1] and rows[0]["hash"] == rows[1]["hash"]
    assert rows[0]["train_loss"] == rows[1]["train_loss"]  # the History is the same on every rank
    return _summaries(rows)


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.fixture(scope="module")
def reference_for_slurm():
    """The same run again, for the SLURM test: one fixture shared with it would put the torchrun tests in the
    SLURM cluster's pytest-xdist group, one after another behind the SLURM tests (tests/conftest.py)."""
    return _reference()


def _launch_together(cmds: list[list[str]], tmp_path, timeout: float) -> list[tuple[int, str]]:
    """Start every command at once (each in its own session), wait for all; kill them all on any exit path."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for name in LAUNCH_VARS:
        env.pop(name, None)
    procs, logs = [], []
    try:
        for i, cmd in enumerate(cmds):
            # A file, not a pipe: a node that fills an unread pipe would block
            # while the test waits on the other node.
            log = open(tmp_path / f"node{i}.log", "w+")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                          start_new_session=True))
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=timeout))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{' '.join(cmds[0])} (x{len(cmds)}) did not finish within {timeout}s")
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
        return list(zip(codes, outputs))
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the node's workers too
            except ProcessLookupError:
                pass
            proc.wait()
        for log in logs:
            log.close()


@pytest.mark.timeout(300)
def test_two_torchrun_nodes_train_like_one_node_with_two_processes(reference, tmp_path):
    port, rdzv_id = find_free_port(), f"nnh-{uuid.uuid4().hex[:8]}"
    node = [*TORCHRUN, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={rdzv_id}", SCRIPT]
    nodes = _launch_together([node, node], tmp_path, timeout=RUN_S)
    for code, output in nodes:
        assert code == 0, output[-4000:]
    rows = parse_results(nodes[0][1] + nodes[1][1])
    # One rank on each node process, as the rendezvous assigned them.
    assert sorted(r["rank"] for r in rows) == [0, 1]
    assert {r["rank"] for r in parse_results(nodes[0][1])} != {r["rank"] for r in parse_results(nodes[1][1])}
    assert _summaries(rows) == reference


@pytest.mark.timeout(300)
def test_elastic_restart_after_a_hard_exit_mid_epoch_resumes_to_the_same_weights(reference, tmp_path):
    # Rank 1 dies after step 5, the 2nd of epoch 2's 3 steps, on the first attempt only.
    result = run_command(_torchrun("--max-restarts=2", SCRIPT, "--ckpt", str(tmp_path), "--die-at", "5"),
                         timeout=RUN_S)
    rows = _ok(result)
    assert re.search(r"exitcode\W+13\W.*local_rank\W+1", result.stdout), result.stdout[-4000:]
    assert [r["restart_count"] for r in rows] == [1, 1]  # the second attempt finished
    assert _summaries(rows) == reference
    # Rotation kept the last two epochs; no temporary file was left behind.
    assert [p.name for p in list_run_checkpoints(tmp_path)] == ["epoch-0003.ckpt", "epoch-0004.ckpt"]
    assert sorted(os.listdir(tmp_path)) == ["epoch-0003.ckpt", "epoch-0004.ckpt"]


@pytest.mark.timeout(300)
def test_sigterm_to_torchrun_checkpoints_exits_75_and_the_same_command_finishes(reference, tmp_path):
    # After step 4, rank 0 sends SIGTERM to its torchrun agent, as a scheduler
    # would; the agent forwards it to both workers.
    cmd = _torchrun(SCRIPT, "--ckpt", str(tmp_path), "--sigterm-launcher-at", "4")
    first = run_command(cmd, timeout=RUN_S)
    assert first.returncode != 0  # torchrun itself reports the signal it got
    rows = parse_results(first.stdout)
    assert [(r["rank"], r["preempted"]) for r in rows] == [(0, PREEMPTED_EXIT_CODE), (1, PREEMPTED_EXIT_CODE)], \
        first.stdout[-4000:]
    # Both ranks stopped after the same step, at or after the one that sent the signal.
    assert rows[0]["global_step"] == rows[1]["global_step"] >= 4
    assert rows[0]["checkpoint"] == rows[1]["checkpoint"]
    payload = load_payload(rows[0]["checkpoint"])
    assert payload["global_step"] == rows[0]["global_step"]
    # A clean exit: no worker printed a traceback (only the torchrun agent reports the signal it got).
    assert "training preempted by SIGTERM" in first.stdout
    assert not re.search(r"\[rank\d\]:\s*Traceback", first.stdout), first.stdout[-4000:]

    second = run_command(cmd, timeout=RUN_S)  # the very same command
    assert _summaries(_ok(second)) == reference


@pytest.mark.timeout(300)
def test_torchrun_summary_names_the_failing_rank_and_its_exception():
    result = run_command(_torchrun(SCRIPT, "--raise-at", "5"), timeout=RUN_S)
    assert result.returncode != 0
    assert "Root Cause" in result.stdout, result.stdout[-4000:]
    root = result.stdout.split("Root Cause", 1)[1].split("=====", 1)[0]
    # Thanks to @record, torchrun's summary carries the failing rank's own
    # exception and traceback, not only "exitcode: 1".
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root), root
    assert "ValueError: bad batch injected on rank 1 at step 5" in root
    assert "scale_case.py" in root and "raise_value_error" in root


# ---------------------------------------------------------------- SLURM, for real


def _same_weights(a, b) -> bool:
    sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _losses(out_dir) -> dict:
    import json

    with open(os.path.join(out_dir, "history.json")) as f:
        history = json.load(f)
    return {k: history[k] for k in ("train_loss", "train_mae", "val_loss", "val_mae", "lr")}


@pytest.fixture(scope="module")
def example_reference(tmp_path_factory):
    """examples/slurm/train.py under torchrun, 2 processes: what srun and sbatch must reproduce."""
    out = tmp_path_factory.mktemp("torchrun_example")
    result = run_command(_torchrun(EXAMPLE, "--out", str(out), "--epochs", "3"), timeout=RUN_S)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "torchrun: 2 rank(s), 3 epochs" in result.stdout
    return out


@pytest.mark.timeout(300)
def test_srun_trains_the_example_to_the_torchrun_weights(slurm_env, example_reference, tmp_path):
    result = run_command(["srun", "-N1", "-n2", "--time=3", sys.executable, EXAMPLE, "--out", str(tmp_path),
                          "--epochs", "3"], env=slurm_env, timeout=RUN_S)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "slurm: 2 rank(s), 3 epochs" in result.stdout  # initialize_ddp found SLURM's variables
    assert _same_weights(tmp_path / "model.pt", example_reference / "model.pt")
    assert _losses(tmp_path) == _losses(example_reference)


@pytest.mark.timeout(400)
def test_sbatch_of_the_example_job_trains_to_the_torchrun_weights(slurm_env, example_reference, tmp_path):
    name = f"nnh-test-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "job.out"
    try:
        result = run_command(["sbatch", "--wait", f"--job-name={name}", f"--output={log}", "--time=4",
                              f"--export=ALL,PYTHON={sys.executable}", "examples/slurm/train.sbatch",
                              "--out", str(tmp_path / "run"), "--epochs", "3"], env=slurm_env, timeout=300)
    finally:
        # sbatch --wait only waits: on a timeout the job itself would go on running.
        subprocess.run(["scancel", f"--name={name}"], env={**os.environ, **slurm_env}, timeout=30,
                       capture_output=True)
    output = log.read_text() if log.exists() else "(no job output)"
    assert result.returncode == 0, result.stdout[-2000:] + output[-4000:]
    assert "slurm: 2 rank(s), 3 epochs" in output
    assert _same_weights(tmp_path / "run" / "model.pt", example_reference / "model.pt")
    assert _losses(tmp_path / "run") == _losses(example_reference)


@pytest.mark.timeout(300)
def test_an_on_rank0_failure_under_srun_ends_both_tasks_with_the_error(slurm_env):
    result = run_command(["srun", "-N1", "-n2", "--time=3", sys.executable, SCRIPT, "--fail-on-rank0"],
                         env=slurm_env, timeout=RUN_S)
    assert result.returncode != 0
    rows = [r for r in parse_results(result.stdout) if "export_error" in r]
    assert [r["rank"] for r in rows] == [0, 1], result.stdout[-4000:]
    assert all(r["is_oserror"] for r in rows)
    assert rows[0]["first_line"] == "could not upload the model after epoch 4"
    assert rows[1]["first_line"].startswith("export failed on rank 0") and "could not upload" in rows[1]["first_line"]
    # srun names the tasks that failed: "task 0: ..." and "task 1: ...", or "tasks 0-1: ...".
    failed = re.findall(r"tasks? ([0-9,-]+): Exited with exit code 1", result.stdout)
    assert sorted(failed) in (["0", "1"], ["0-1"]), result.stdout[-4000:]


@pytest.mark.timeout(300)
def test_scancel_signal_under_srun_exits_75_and_the_rerun_finishes(slurm_env, reference_for_slurm, tmp_path):
    cmd = ["srun", "-N1", "-n2", "--time=3", sys.executable, SCRIPT, "--ckpt", str(tmp_path), "--scancel-at", "4"]
    first = run_command(cmd, env=slurm_env, timeout=RUN_S)
    # srun passes the tasks' exit code on: the job says "preempted, rerun me".
    assert first.returncode == PREEMPTED_EXIT_CODE, first.stdout[-4000:]
    assert [r.get("preempted") for r in parse_results(first.stdout)] == [PREEMPTED_EXIT_CODE] * 2
    second = run_command(cmd, env=slurm_env, timeout=RUN_S)
    rows = _ok(second)
    assert {r["launcher"] for r in rows} == {"slurm"}
    assert _summaries(rows) == reference_for_slurm

"""Every script in examples/ runs on this machine with small sizes, one subprocess each, and does what it says."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from helpers import REPO, run_command, without_extras_env
from nn_handler.utils.ddp import find_free_port

# Below the pytest-timeout backstop, so that a hang names the command and shows its output.
DEADLINE = 240
pytestmark = pytest.mark.timeout(DEADLINE + 60)

EXAMPLES = REPO / "examples"
CPU_ONLY = not torch.cuda.is_available()


def run_example(name: str, *args: str, torchrun: bool = False, env: dict | None = None):
    script = str(EXAMPLES / name)
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={find_free_port()}", script, *args]
    else:
        cmd = [sys.executable, script, *args]
    result = run_command(cmd, timeout=DEADLINE, env=env)
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


TESTED = {"quickstart.py", "process_on_gpu.py", "matrix_multiply.py", "executor_context.py", "checkpoint_rank0.py",
          "train_ddp.py", "predict.py", "ddp_init.py", "hf_finetune.py", "gan.py", "embed_sequences.py",
          "ray_train.py"}  # needs Ray: run by tests/cluster/test_ray_train.py


def test_every_example_has_a_smoke_test():
    assert {p.name for p in EXAMPLES.glob("*.py")} == TESTED


def test_quickstart():
    out = run_example("quickstart.py", "--size", "64", "--tasks", "4")
    part1 = re.search(r"^\[1\] @parallelize_on_gpus on (.+?) \(pids (.+?)\): trace\(A\^4\) = \[(.+?)\]", out, re.M)
    assert part1, out
    devices, pids, traces = part1.group(1).split(", "), part1.group(2).split(", "), part1.group(3).split(", ")
    assert len(set(pids)) == len(devices) == len(traces) and len(set(traces)) == 1  # same seed on every device
    if CPU_ONLY:
        assert devices == ["cpu", "cpu"]
    part2 = re.search(r"^\[2\] ParallelExecutor.map over 4 tasks on .+: \[(.+)\]", out, re.M)
    assert part2 and len(part2.group(1).split(", ")) == 4, out
    readers = re.findall(r"rank (\d) \(pid (\d+)\) read pid (\d+)'s file", out)
    assert [r[0] for r in readers] == [str(i) for i in range(len(readers))] and len(readers) >= 2, out
    writer = readers[0][1]
    assert all(read == writer for _, _, read in readers)  # rank 0 wrote it once, every rank read that file
    assert re.search(r"^done in \d+\.\d+ s$", out, re.M)


def test_process_on_gpu():
    out = run_example("process_on_gpu.py")
    results = re.search(r"process_on_gpu: (\d+) results, one per device: (.+)$", out, re.M)
    assert results, out
    assert eval(results.group(2)) == [[2, 4, 6]] * int(results.group(1))
    assert "another_gpu_function: [[4, 6], [4, 6]]" in out


def test_matrix_multiply():
    out = run_example("matrix_multiply.py", "--size", "64", "--iterations", "2")
    n = int(re.search(r"Received (\d+) results, one from each device", out).group(1))
    assert n == (2 if CPU_ONLY else torch.cuda.device_count())
    assert len(re.findall(r"device \d: Tensor \(64, 64\)", out)) == n


def test_matrix_multiply_without_numpy(tmp_path):
    out = run_example("matrix_multiply.py", "--size", "32", "--iterations", "1", env=without_extras_env(tmp_path))
    assert re.search(r"device 0: Tensor \(32, 32\)", out), out


def test_executor_context():
    out = run_example("executor_context.py")
    if CPU_ONLY:
        assert "run on ['cpu', 'cpu']: [[2, 4, 6], [2, 4, 6]]" in out
    assert "map: 4 batches through one model per worker" in out
    assert re.search(r"a failing task raises here.*: fails_on_odd failed on rank \d \(.+\): ValueError: odd input [13]",
                     out)
    assert "the pool is still usable: [0, 2]" in out


def test_checkpoint_rank0_under_torchrun(tmp_path):
    out = run_example("checkpoint_rank0.py", "--out", str(tmp_path), "--epochs", "2", torchrun=True)
    assert out.count("Checkpoint saved to") == 2  # rank 0 only, once per epoch
    assert len(re.findall(r"rank 1/2: epoch \d loss [\d.]+ saved=False", out)) == 2
    assert len(re.findall(r"rank 0/2: epoch \d loss [\d.]+ saved=True", out)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.pt", "epoch1.pt", "epoch2.pt"]
    checkpoint = torch.load(tmp_path / "epoch2.pt", weights_only=True)
    assert checkpoint["epoch"] == 2 and set(checkpoint["model"]) == {"weight", "bias"}


def _val_losses(out: str) -> str:
    match = re.search(r"^val_loss per epoch: (.+)$", out, re.M)
    assert match, out
    return match.group(1)


def test_train_ddp_with_launch_and_under_torchrun_agree(tmp_path):
    args = ["--epochs", "3", "--samples", "96"]
    launched = run_example("train_ddp.py", "--out", str(tmp_path / "launch"), *args)
    assert re.search(r"^2 rank\(s\) on \S+, 3 epochs", launched, re.M), launched
    torchrun = run_example("train_ddp.py", "--out", str(tmp_path / "torchrun"), *args, torchrun=True)
    # The same script: under torchrun, NNHandler.launch trains in torchrun's own ranks.
    assert re.search(r"^2 rank\(s\) on \S+, 3 epochs", torchrun, re.M), torchrun
    # The same seed and data: the same History, whichever way the 2 processes were started.
    assert _val_losses(launched) == _val_losses(torchrun)
    losses = [float(v) for v in _val_losses(launched).split(", ")]
    assert losses[-1] < losses[0]
    for run in ("launch", "torchrun"):
        out_dir = tmp_path / run
        assert sorted(p.name for p in out_dir.iterdir()) == ["ckpt", "history.csv", "history_steps.csv",  # CSVLogger's
                                                             "loss_curve.png", "model.pt"]
        assert (out_dir / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert len((out_dir / "history.csv").read_text().splitlines()) == 1 + 3
        assert sorted(p.name for p in (out_dir / "ckpt").iterdir()) == ["best.ckpt", "last.ckpt"]


def test_train_ddp_without_matplotlib_skips_the_plot_in_one_line(tmp_path):
    out = run_example("train_ddp.py", "--out", str(tmp_path / "run"), "--epochs", "2", "--samples", "64",
                      "--nprocs", "1", env=without_extras_env(tmp_path))
    assert out.count("matplotlib") == 1, out
    assert "no loss_curve.png: matplotlib is not installed (pip install 'nn_handler[plot]')" in out
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["ckpt", "history.csv", "history_steps.csv", "model.pt"]


def _gan_losses(out: str) -> list[tuple[float, float]]:
    return [(float(d), float(g)) for d, g in re.findall(r"^epoch \d+: loss_d=(\d+\.\d+) loss_g=(\d+\.\d+)$", out, re.M)]


def test_gan_in_one_process_and_with_launch(tmp_path):
    one = run_example("gan.py", "--epochs", "3", "--samples", "512", "--nprocs", "1")
    assert len(_gan_losses(one)) == 3, one
    assert re.search(r"^1 rank\(s\), 3 epochs in [\d.]+ s; generated points lie at radius", one, re.M)
    two = run_example("gan.py", "--epochs", "2", "--samples", "512", "--out", str(tmp_path))
    assert len(_gan_losses(two)) == 2 and re.search(r"^2 rank\(s\), 2 epochs", two, re.M), two
    exported = torch.load(tmp_path / "gan.pt", weights_only=True)  # both models by name, from rank 0
    assert set(exported) == {"G", "D"}


def test_predict():
    out = run_example("predict.py", "--samples", "300", "--batch-size", "32")
    assert re.search(r"\(300, 4\) outputs for 300 samples in [\d.]+ s; equal to a single-process pass in order: True",
                     out), out


def test_embed_sequences(tmp_path):
    pytest.importorskip("transformers")
    # One CPU worker and 40 sequences: each process that builds the model imports transformers (seconds each),
    # the check runs a sequence at a time, and the run is killed and resumed the same way as a larger one.
    out = run_example("embed_sequences.py", "--sequences", "40", "--max-length", "256", "--devices", "cpu",
                      env={"TMPDIR": str(tmp_path)})
    assert not list(tmp_path.glob("embed_sequences-*")), "the example left its temporary directory behind"
    killed = re.search(r"^killed the run with (\d+) of 40 items on disk", out, re.M)
    assert killed and int(killed[1]) >= 20, out
    if int(killed[1]) < 40:  # killed before the end (nearly always): the rerun said what it resumed
        assert re.search(rf"{killed[1]}( of [\d,]+)? items done in .*, resuming", out), out
    assert "pooled (40, 32), per residue (length, 32) each; equal to a plain loop, one sequence at a time: True" in out


def test_ddp_init_plain_python():
    out = run_example("ddp_init.py")
    assert "not distributed; running on " in out and re.search(r"rank 0: one step done, loss -?\d+\.\d+", out)


def test_an_example_that_needs_an_extra_says_which_and_is_marked_for_the_newcomer_path(tmp_path):
    # .ci/newcomer runs every example with no extras, except those marked "# needs-extra:".
    needing = {p.name for p in EXAMPLES.glob("*.py") if re.search(r"import (ray|transformers)|from transformers",
                                                                  p.read_text())}
    marked = {p.name for p in EXAMPLES.glob("*.py") if re.search(r"^# needs-extra: ", p.read_text(), re.M)}
    assert needing == marked == {"ray_train.py", "hf_finetune.py", "embed_sequences.py"}
    # transformers imports numpy, which the environment without extras hides.
    result = run_command([sys.executable, str(EXAMPLES / "hf_finetune.py")], timeout=120,
                         env=without_extras_env(tmp_path))
    assert result.returncode == 1 and "pip install 'nn_handler[hf]'" in result.stdout
    result = run_command([sys.executable, str(EXAMPLES / "ray_train.py")], timeout=120,
                         env=without_extras_env(tmp_path))
    assert result.returncode == 1
    assert "pip install 'nn_handler[ray]' 'ray[train]'" in result.stdout


def test_hf_finetune():
    pytest.importorskip("transformers")
    out = run_example("hf_finetune.py", "--epochs", "2")
    losses = re.search(r"train_loss (\d+\.\d+) -> (\d+\.\d+)", out)
    assert losses and float(losses[2]) < float(losses[1]), out
    assert "predict: CausalLMOutputWithCrossAttentions logits (8, 16, 128)" in out
    assert "load into a fresh GPT2LMHeadModel (lm_head tied: True)" in out

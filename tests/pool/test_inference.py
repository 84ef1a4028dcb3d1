"""parallel_predict as a batch-inference engine (issue 50), on two CPU workers: ragged outputs, per-item lists,
token budgets, output_dir, resume after a SIGKILL, iterable input, failing batches and the caller's memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from helpers import REPO, pids_alive
from nn_handler import NNHandler, Predictions
from nn_handler._padding import pad_concat
from nn_handler.errors import ConfigurationError, ParallelExecutionError, PredictionsError
from nn_handler.utils.parallel import parallel_predict
from scripts.promises_case import LENGTHS, Tagger, pad_each_batch, token_samples

CPUS = ["cpu", "cpu"]
TIMEOUT = 180  # a subprocess's hard deadline (the machine is shared and loaded)

# 30 sequences of lengths 1..12, in a fixed shuffled order
SEQ_LENGTHS = [5, 12, 1, 7, 3, 9, 2, 11, 4, 8, 6, 10, 1, 12, 3, 5, 7, 2, 9, 4, 11, 6, 8, 10, 2, 1, 3, 12, 5, 7]


def sequences() -> list[torch.Tensor]:
    return [torch.arange(1.0, n + 1) + 100 * i for i, n in enumerate(SEQ_LENGTHS)]


def pad_zero(samples: list[torch.Tensor]) -> torch.Tensor:
    return nn.utils.rnn.pad_sequence(samples, batch_first=True)


class PerToken(nn.Module):
    """(batch, positions, 2): each position on its own, so an item's rows equal its rows run alone."""

    def forward(self, x):
        return torch.stack([x, -x], dim=-1)


def alone(x: torch.Tensor) -> torch.Tensor:
    return PerToken()(x[None])[0]


# --- 1. ragged outputs in memory -------------------------------------------------------------------


def test_ragged_outputs_are_padded_with_minus_100_as_predict_pads_them():
    model = Tagger()
    loader = DataLoader(token_samples(), batch_size=3, collate_fn=pad_each_batch)
    plain = NNHandler(model).predict(loader)  # one process, a plain loop
    scores, (hidden, first), _ = parallel_predict(model, loader, device_ids=CPUS)
    torch.testing.assert_close((scores, hidden, first), (plain[0], *plain[1]))
    data_parallel = NNHandler(model).predict(loader, data_parallel=True, device_ids=CPUS)
    torch.testing.assert_close(data_parallel[:2], plain[:2])
    assert data_parallel[2] is None and plain[2] is None  # a scalar (the loss) left out, as predict() does
    assert (scores[0, max(LENGTHS[:3]):] == -100).all()


# --- 2. a list of per-sample outputs -------------------------------------------------------------


class PerSample(nn.Module):
    """One output per sample, each of its own length: a list, not a batched tensor."""

    def forward(self, x):
        return [row[: int(row[0]) % 3 + 1] for row in x]


def test_a_list_of_per_sample_outputs_is_one_output_per_input_in_input_order():
    x = torch.arange(10.0).unsqueeze(1).repeat(1, 4)  # N=10 with batch_size=4: the last batch is short
    out = parallel_predict(PerSample(), x, batch_size=4, device_ids=CPUS)
    assert isinstance(out, list) and len(out) == 10
    for i, item in enumerate(out):
        torch.testing.assert_close(item, PerSample()(x[i:i + 1])[0])


class TwoBatchedOutputs(nn.Module):
    """Two batched outputs in a list: a list as long as its batch is read as one output per item."""

    def __init__(self, container=list):
        super().__init__()
        self.container = container

    def forward(self, x):
        return self.container([x * 2, x + 1])


def test_a_list_of_batched_outputs_read_per_item_for_some_batches_only_stops_the_run(tmp_path):
    x = torch.arange(10.0).reshape(5, 2)  # batch_size=2: batches of 2, 2 and 1; the list of 2 is per item for two
    with pytest.raises(TypeError, match="for the batch of items [02]-[13], and not for the batch of item 4; return "
                                        "several batched outputs as a tuple or a dict") as info:
        parallel_predict(TwoBatchedOutputs(), x, batch_size=2, output_dir=tmp_path, device_ids=CPUS)
    assert "overwrite=True" in str(info.value)
    with pytest.raises(TypeError, match="as a tuple or a dict"):  # in memory: the same error
        parallel_predict(TwoBatchedOutputs(), x, batch_size=2, device_ids=CPUS)
    # Every item is on disk, nested two ways: the same call with the model mended is refused, not read back mixed.
    mended = TwoBatchedOutputs(container=tuple)
    with pytest.raises(PredictionsError, match="nested in 2 ways .* pass overwrite=True"):
        parallel_predict(mended, x, batch_size=2, output_dir=tmp_path, device_ids=CPUS)
    preds = parallel_predict(mended, x, batch_size=2, output_dir=tmp_path, overwrite=True, device_ids=CPUS)
    assert len(preds) == 5
    for i, item in enumerate(preds):
        assert isinstance(item, tuple)
        torch.testing.assert_close(item, (x[i] * 2, x[i] + 1))


# --- 3. token budgets ----------------------------------------------------------------------------


def test_token_budget_batches_stay_within_the_budget_and_outputs_come_back_in_input_order(tmp_path):
    class Recording(PerToken):
        def forward(self, x):
            with open(os.path.join(str(tmp_path), f"shapes-{os.getpid()}"), "a") as f:
                f.write(f"{x.shape[0]} {x.shape[1]}\n")
            return super().forward(x)

    seqs = sequences()
    out = parallel_predict(Recording(), seqs, collate_fn=pad_zero, max_tokens=24, length=len, device_ids=CPUS)
    shapes = [tuple(map(int, line.split())) for name in os.listdir(tmp_path)
              for line in open(tmp_path / name).read().splitlines()]
    assert sum(count for count, _ in shapes) == len(seqs) and len({name for name in os.listdir(tmp_path)}) == 2
    assert all(count * longest <= 24 for count, longest in shapes)
    assert out.shape == (30, 12, 2)
    for i, x in enumerate(seqs):
        torch.testing.assert_close(out[i, :len(x)], alone(x))


# --- 4. output_dir -------------------------------------------------------------------------------


def test_output_dir_reads_back_equal_to_memory_and_opens_later_without_the_model(tmp_path):
    seqs = sequences()
    in_memory = parallel_predict(PerToken(), seqs, collate_fn=pad_zero, batch_size=4, device_ids=CPUS)
    preds = parallel_predict(PerToken(), seqs, collate_fn=pad_zero, batch_size=4, length=len,
                             output_dir=tmp_path / "out", device_ids=CPUS)
    assert isinstance(preds, Predictions) and len(preds) == 30
    for i, x in enumerate(seqs):  # trimmed to each item's own length on disk
        assert preds[i].shape == (len(x), 2)
        torch.testing.assert_close(preds[i], in_memory[i, :len(x)])
    script = ("import sys, torch; from nn_handler import Predictions; p = Predictions.open(sys.argv[1]); "
              "torch.save([p[i] for i in range(len(p))], sys.argv[2])")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "out"), str(tmp_path / "read.pt")], check=True,
                   timeout=TIMEOUT, cwd=tmp_path)  # a fresh process, without the model's class
    for got, x in zip(torch.load(tmp_path / "read.pt"), seqs):
        torch.testing.assert_close(got, alone(x))


# --- 5. resume after a SIGKILL of the whole job --------------------------------------------------

JOB = textwrap.dedent("""
    import os, sys, time, torch
    from torch import nn
    from nn_handler import parallel_predict

    out, counter, stop_at = sys.argv[1], sys.argv[2], int(sys.argv[3])

    class Counting(nn.Module):
        def forward(self, x):
            if int(x[:, 0].max()) >= stop_at:
                while True:  # this batch never finishes: the job is killed with it in flight
                    time.sleep(0.05)
            with open(counter, "a") as f:
                f.write("".join(f"{int(v)}\\n" for v in x[:, 0]))
            return x * 2

    if __name__ == "__main__":
        x = torch.arange(40.0).unsqueeze(1).repeat(1, 3)
        parallel_predict(Counting(), x, batch_size=4, output_dir=out, device_ids=["cpu", "cpu"])
""")


class Counting(nn.Module):
    """The job's model, without its stop: doubles its input and logs each item it computes to ``counter``."""

    def __init__(self, counter: str):
        super().__init__()
        self.counter = counter

    def forward(self, x):
        with open(self.counter, "a") as f:
            f.write("".join(f"{int(v)}\n" for v in x[:, 0]))
        return x * 2


def _start_job(tmp_path, stop_at: int) -> subprocess.Popen:
    (tmp_path / "job.py").write_text(JOB)
    return subprocess.Popen([sys.executable, str(tmp_path / "job.py"), str(tmp_path / "out"),
                             str(tmp_path / "counter"), str(stop_at)], cwd=tmp_path, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _counted(tmp_path) -> list[int]:
    path = tmp_path / "counter"
    return [int(v) for v in path.read_text().split()] if path.exists() else []


def test_a_killed_job_resumes_computing_only_the_missing_items_and_equals_an_uninterrupted_run(tmp_path, capfd):
    job = _start_job(tmp_path, stop_at=20)
    try:  # wait for the items before 20 (5 shards of 4) to be on disk, with the batch of 20 stuck in flight
        deadline = time.monotonic() + TIMEOUT
        while len([n for n in os.listdir(tmp_path / "out") if n.endswith(".safetensors")]
                  if (tmp_path / "out").exists() else []) < 5:
            assert job.poll() is None, job.communicate()
            assert time.monotonic() < deadline, "the job wrote no shard in time"
            time.sleep(0.05)
        children = [int(p) for p in subprocess.run(["pgrep", "-g", str(job.pid)], capture_output=True,
                                                   text=True).stdout.split()]
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)  # the whole job: the caller and its workers
        except ProcessLookupError:  # it ended on its own (a failure, said above)
            pass
        job.communicate()
    deadline = time.monotonic() + 30
    while pids_alive(children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pids_alive(children)
    before = _counted(tmp_path)
    done_before = len([n for n in os.listdir(tmp_path / "out") if n.endswith(".safetensors")]) * 4
    assert 20 <= done_before < 40

    # The same call again, here (the job's model, on this process's workers): it computes only what is missing.
    x = torch.arange(40.0).unsqueeze(1).repeat(1, 3)
    preds = parallel_predict(Counting(str(tmp_path / "counter")), x, batch_size=4, output_dir=tmp_path / "out",
                             device_ids=CPUS)
    err = capfd.readouterr().err
    assert f"{done_before} of 40 items done" in err and "resuming" in err
    recomputed = _counted(tmp_path)[len(before):]
    assert sorted(recomputed) == [i for i in range(40) if i not in set(before)] and len(recomputed) == 40 - done_before
    torch.testing.assert_close(preds.stack(), x * 2)  # what the uninterrupted run gives (x * 2 for every item)

    # A rerun over other data is refused before anything starts (overwrite=True would start over).
    with pytest.raises(ConfigurationError, match=r"(?s)out.*n_items.*40.*41.*overwrite=True"):
        parallel_predict(nn.Identity(), torch.zeros(41, 3), batch_size=4, output_dir=tmp_path / "out",
                         device_ids=CPUS)
    with pytest.raises(ConfigurationError, match=r"(?s)out.*batch_size.*4.*8"):
        parallel_predict(nn.Identity(), torch.arange(40.0).unsqueeze(1).repeat(1, 3), batch_size=8,
                         output_dir=tmp_path / "out", device_ids=CPUS)


# --- 6 and 7. a generator input, a failing batch, resume -----------------------------------------


class FailsAt(nn.Module):
    """Doubles its input; raises on a batch holding item ``bad`` (the value of its first column)."""

    def __init__(self, bad: int, counter: str):
        super().__init__()
        self.bad, self.counter = bad, counter

    def forward(self, x):
        if (x[:, 0] == self.bad).any():
            raise ValueError(f"bad input {self.bad}")
        with open(self.counter, "a") as f:
            f.write("".join(f"{int(v)}\n" for v in x[:, 0]))
        return x * 2


def rows(n: int):
    return (torch.full((3,), float(i)) for i in range(n))  # a generator: no len


def test_a_failing_batch_fails_after_the_others_are_on_disk_and_a_generator_resumes(tmp_path):
    out, counter = tmp_path / "out", str(tmp_path / "counter")
    with pytest.raises(ValueError, match="bad input 13") as info:
        parallel_predict(FailsAt(13, counter), rows(30), batch_size=4, output_dir=out, device_ids=CPUS)
    assert isinstance(info.value, ParallelExecutionError)
    assert "items 12-15" in "".join(info.value.__notes__) and "raise ValueError" in str(info.value.__cause__)
    first = _counted(tmp_path)
    # Every batch computed, those in flight when the failure came back included, is on disk before the call fails.
    # shard-<first item>-<item count>.safetensors: the last batch (items 28, 29) holds 2 items, not 4.
    on_disk = sum(int(name[:-len(".safetensors")].rsplit("-", 1)[1]) for name in os.listdir(out)
                  if name.startswith("shard-") and name.endswith(".safetensors"))
    assert 12 not in first and len(first) >= 8 and on_disk == len(first)

    preds = parallel_predict(FailsAt(-1, counter), rows(30), batch_size=4, output_dir=out, device_ids=CPUS)
    second = _counted(tmp_path)[len(first):]
    assert sorted(first + second) == list(range(30))  # each item computed exactly once over the two runs
    torch.testing.assert_close(preds.stack(), torch.stack(list(rows(30))) * 2)


class Oom(nn.Module):
    """Runs out of "memory" above 2 items; item 13 is a bad input."""

    def forward(self, x):
        if len(x) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        if (x[:, 0] == 13).any():
            raise ValueError("bad input 13")
        return x * 2


def test_out_of_memory_splits_the_batch_and_skip_records_what_failed(tmp_path):
    preds = parallel_predict(Oom(), torch.arange(20.0).unsqueeze(1), batch_size=4, output_dir=tmp_path,
                             on_error="skip", device_ids=CPUS)
    assert len(preds.failed) == 1 and "bad input 13" in preds.failed[0]["error"]
    failed = {12, 13}  # the batch 12-15 that holds 13, split in two halves: 12-13 failed, 14-15 ran and are kept
    assert (preds.failed[0]["start"], preds.failed[0]["stop"]) == (12, 14)
    for i in range(20):
        if i in failed:
            with pytest.raises(Exception, match=f"item {i}"):
                preds[i]
        else:
            assert preds[i].tolist() == [2.0 * i]


# --- 9. the caller's memory ----------------------------------------------------------------------

MEMORY = textwrap.dedent("""
    import resource, sys, torch
    from torch import nn
    from torch.utils.data import Dataset
    from nn_handler import parallel_predict

    class Rows(Dataset):
        def __init__(self, n):
            self.n = n
        def __len__(self):
            return self.n
        def __getitem__(self, i):
            return torch.full((640,), float(i))

    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB

    if __name__ == "__main__":
        base = peak()
        growth = []
        for n in (2_000, 20_000):
            parallel_predict(nn.Identity(), Rows(n), batch_size=125, output_dir=f"{sys.argv[1]}/{n}",
                             device_ids=["cpu", "cpu"])
            growth.append(peak() - base)
        print("GROWTH", *growth)
""")


def test_the_callers_memory_does_not_grow_with_the_data_set(tmp_path):
    (tmp_path / "memory.py").write_text(MEMORY)
    run = subprocess.run([sys.executable, str(tmp_path / "memory.py"), str(tmp_path)], capture_output=True,
                         text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    small, large = map(float, run.stdout.split("GROWTH")[1].split())
    # 20,000 items x 640 floats are 49 MiB of outputs (and as much input): held in the caller, the peak would
    # grow by that much over the 2,000 items' run (measured: 95 MiB more with the outputs in memory, 0.6 with
    # output_dir).
    # The batches in flight weigh the same in both runs: the smaller run has 16 batches, more than are in flight.
    assert large - small < 8, (small, large)

"""checkpoint_dir / resume / preemption without launchers: one process, and 2 spawned gloo ranks.

The launcher tests (torchrun restarts, SIGTERM through torchrun, SLURM) are
in test_scaling_launchers.py; these pin the exact-resume logic down where a
failure is cheap to read.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import pytest
import torch

from nn_handler import PREEMPTED_EXIT_CODE, Callback, NNHandler, TrainingPreempted
from nn_handler.checkpoint import (FORMAT, atomic_save, list_run_checkpoints, load_payload, prune_run_checkpoints,
                                   run_checkpoint_key)
from nn_handler.errors import CheckpointError, ConfigurationError
from nn_handler.testing import run_distributed
from scripts.scale_case import EPOCHS, AtStep, build, build_deciding, decisions, sigterm_to, summary
from scripts.scale_case import outcome as _outcome

TIMEOUT = 150


@pytest.fixture(scope="module")
def straight():
    """The uninterrupted single-process run every resumed run must equal."""
    handler = build()
    handler.train(EPOCHS, progress=False)
    return summary(handler)


def _crash(handler):
    raise RuntimeError("simulated crash")


def test_a_checkpoint_after_every_epoch_keeps_the_last_two(tmp_path, straight):
    handler = build(tmp_path)
    handler.train(EPOCHS, progress=False)
    assert summary(handler) == straight  # checkpointing changes nothing
    assert sorted(os.listdir(tmp_path)) == ["epoch-0003.ckpt", "epoch-0004.ckpt"]  # keep_last=2, no temp file
    payload = load_payload(tmp_path / "epoch-0004.ckpt")
    assert payload["epoch"] == 4 and payload["global_step"] == 24 and payload["stopped"] is False
    assert "partial" not in payload


def test_auto_resume_after_a_crash_mid_epoch_equals_an_uninterrupted_run(tmp_path, straight):
    # Step 15 is the 3rd of epoch 3's 6 steps: epoch 2's checkpoint is the newest.
    first = build(tmp_path, callbacks=[AtStep(15, _crash)])
    with pytest.raises(RuntimeError, match="simulated crash"):
        first.train(EPOCHS, progress=False)
    assert [p.name for p in list_run_checkpoints(tmp_path)] == ["epoch-0001.ckpt", "epoch-0002.ckpt"]
    torch.rand(5)  # a new process would start from other random states
    second = build(tmp_path, resume="auto")
    second.train(EPOCHS, progress=False)
    assert summary(second) == straight
    # The rerun continued the same run: it pruned the first process's checkpoints as its own.
    assert [p.name for p in list_run_checkpoints(tmp_path)] == ["epoch-0003.ckpt", "epoch-0004.ckpt"]


def test_sigterm_mid_epoch_writes_that_point_and_the_rerun_finishes_identically(tmp_path, straight):
    calls = []

    def previous(signum, frame):
        calls.append(signum)

    old = signal.signal(signal.SIGTERM, previous)
    try:
        # SIGTERM to this very process after step 8: 2 steps (4 batches) into epoch 2.
        first = build(tmp_path, callbacks=[AtStep(8, sigterm_to(os.getpid))])
        with pytest.raises(TrainingPreempted) as info:
            first.train(EPOCHS, progress=False)
        # The script's own handler is back, and the signal did not reach it during train.
        assert signal.getsignal(signal.SIGTERM) is previous and calls == []
    finally:
        signal.signal(signal.SIGTERM, old)
    exc = info.value
    assert exc.code == PREEMPTED_EXIT_CODE and (exc.epoch, exc.batches, exc.signal_name) == (2, 4, "SIGTERM")
    assert os.path.basename(exc.checkpoint) == "epoch-0002-batch-000004.ckpt"
    assert "rerun the same command" in str(exc)
    assert first.global_step == 8  # it finished the step it was in, and took no other
    payload = load_payload(exc.checkpoint)
    assert payload["partial"]["batches"] == 4 and len(payload["partial"]["ranks"][0]["sizes"]) == 4
    assert [run_checkpoint_key(p) for p in list_run_checkpoints(tmp_path)] == [(1, 0), (1, 4)]

    second = build(tmp_path, resume="auto")
    second.train(EPOCHS, progress=False)
    assert summary(second) == straight


def test_a_second_preemption_in_the_resumed_epoch_still_ends_identically(tmp_path, straight):
    # The resumed run keeps the epoch's original start state, so a checkpoint
    # written a second time inside the same epoch replays the same batch order.
    with pytest.raises(TrainingPreempted):
        build(tmp_path, callbacks=[AtStep(8, sigterm_to(os.getpid))]).train(EPOCHS, progress=False)
    with pytest.raises(TrainingPreempted) as info:
        build(tmp_path, resume="auto", callbacks=[AtStep(10, sigterm_to(os.getpid))]).train(EPOCHS, progress=False)
    assert (info.value.epoch, info.value.batches) == (2, 8)
    third = build(tmp_path, resume="auto")
    third.train(EPOCHS, progress=False)
    assert summary(third) == straight


class _StopAfter(Callback):
    def __init__(self, epoch):
        self.epoch = epoch

    def on_epoch_end(self, handler, epoch, logs):
        if epoch == self.epoch:
            handler.stop_training = True


def test_rerunning_a_run_that_stopped_early_trains_nothing_more(tmp_path):
    first = build(tmp_path, callbacks=[_StopAfter(2)])
    first.train(EPOCHS, progress=False)
    assert first.epoch == 2
    again = build(tmp_path, resume="auto")
    again.train(EPOCHS, progress=False)
    assert again.epoch == 2 and summary(again)["hash"] == summary(first)["hash"]


def test_resume_settings_are_checked(tmp_path):
    with pytest.raises(ConfigurationError, match="resume='auto' looks for checkpoints in checkpoint_dir"):
        build(resume="auto")
    with pytest.raises(ConfigurationError, match="keep_last must be an int >= 1, got 0"):
        NNHandler(torch.nn.Linear(2, 1), checkpoint_dir=tmp_path, keep_last=0)
    with pytest.raises(ConfigurationError, match="resume must be None, 'auto' or a checkpoint path"):
        NNHandler(torch.nn.Linear(2, 1), resume=3)
    missing = build(resume=tmp_path / "nope.ckpt")
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        missing.train(1, progress=False)


def test_auto_resume_skips_a_damaged_newest_file_and_stale_temp_files(tmp_path, straight):
    first = build(tmp_path)
    first.train(2, progress=False)
    (tmp_path / "epoch-0003.ckpt").write_bytes(b"not a checkpoint")  # newest by name, unreadable
    stale = tmp_path / ".epoch-0003.ckpt.tmp.4242.deadbeef"  # a write that a crash interrupted
    stale.write_bytes(b"half")
    (tmp_path / "best.ckpt").write_bytes(b"another tool's file")  # not ours: ignored, kept
    second = build(tmp_path, resume="auto")
    second.train(EPOCHS, progress=False)
    assert summary(second) == straight
    assert not stale.exists() and (tmp_path / "best.ckpt").exists()


def test_no_checkpoint_yet_starts_from_the_beginning(tmp_path, straight):
    handler = build(tmp_path / "empty", resume="auto")
    handler.train(EPOCHS, progress=False)
    assert summary(handler) == straight


# ---------------------------------------------------------------- a stop inside an epoch decides nothing
# build_deciding: EarlyStopping and ModelCheckpoint(save_best_only) on train_loss, over data whose first
# half is easy, so a part of an epoch looks better than the whole of it. Uninterrupted, the run stops
# early after epoch 4 (of 4) and best.ckpt holds epoch 4's weights.


@pytest.fixture(scope="module")
def deciding(tmp_path_factory):
    """The uninterrupted single-process run of build_deciding."""
    where = tmp_path_factory.mktemp("deciding")
    handler = build_deciding(where / "best", where / "ckpt")
    handler.train(EPOCHS, progress=False)
    outcome = _outcome(handler, where / "ckpt")
    assert outcome["stopper"]["stopped_epoch"] == 4 and outcome["stopped"] is True  # the case decides something
    return outcome


def test_stops_inside_epochs_then_continuing_in_the_same_handler_decide_as_an_uninterrupted_run(tmp_path,
                                                                                                deciding):
    handler = build_deciding(tmp_path / "best")
    handler.train(EPOCHS, max_steps=8, progress=False)  # 2 of epoch 2's 6 steps: its easy part
    assert handler.partial_epoch and handler.history["epoch"] == [1, 2] and not handler.stop_training
    assert decisions(handler)["best"][:2] == (1, 6)  # best.ckpt holds epoch 1, not the part of epoch 2
    handler.train(EPOCHS, max_time=1e-6, progress=False)  # out of time after the next step
    assert handler.global_step == 9 and handler.partial_epoch
    handler.train(EPOCHS, progress=False)
    assert not handler.partial_epoch
    assert {**_outcome(handler), "stopped": True} == deciding


def test_stops_inside_epochs_then_auto_resumes_decide_as_an_uninterrupted_run(tmp_path, deciding):
    best, ckpt = tmp_path / "best", tmp_path / "ckpt"
    build_deciding(best, ckpt).train(EPOCHS, max_steps=8, progress=False)
    torch.rand(5)  # a new process would start from other random states
    second = build_deciding(best, ckpt, resume="auto")
    second.train(EPOCHS, max_time=1e-6, progress=False)
    assert second.global_step == 9
    # SIGTERM after step 15, the 3rd of epoch 3's 6 steps.
    with pytest.raises(TrainingPreempted) as info:
        build_deciding(best, ckpt, resume="auto", callbacks=[AtStep(15, sigterm_to(os.getpid))]).train(
            EPOCHS, progress=False)
    assert (info.value.epoch, info.value.batches) == (3, 6)
    last = build_deciding(best, ckpt, resume="auto")
    last.train(EPOCHS, progress=False)
    assert _outcome(last, ckpt) == deciding
    again = build_deciding(best, ckpt, resume="auto")  # the job rerun: it stopped early, as the straight run did
    again.train(EPOCHS, progress=False)
    assert again.global_step == 24 and again.history["epoch"] == [1, 2, 3, 4]


def _deciding_body(rank, where, phase):
    import os
    from pathlib import Path

    from nn_handler import TrainingPreempted
    from scripts.scale_case import EPOCHS, AtStep, build_deciding, sigterm_to
    from scripts.scale_case import outcome as _outcome

    where = Path(where)
    best, ckpt = where / "best", where / "ckpt"
    if phase == "first":  # the uninterrupted run, the same-handler continuation, and a run stopped at step 4
        straight = build_deciding(where / "straight-best", where / "straight-ckpt")
        straight.train(EPOCHS, progress=False)
        same = build_deciding(where / "same-best", check_every=1)
        same.train(EPOCHS, max_steps=4, progress=False)  # 1 of epoch 2's 3 steps
        same.train(EPOCHS, max_time=1e-6, progress=False)  # out of time after the next
        steps = same.global_step
        same.train(EPOCHS, progress=False)
        build_deciding(best, ckpt).train(EPOCHS, max_steps=4, progress=False)
        return {"straight": _outcome(straight, where / "straight-ckpt"), "same": {**_outcome(same), "steps": steps}}
    if phase == "second":  # resumed at step 4: out of time after step 5, then SIGTERM on rank 1 after step 8
        handler = build_deciding(best, ckpt, resume="auto", check_every=1,
                                 callbacks=[AtStep(8, sigterm_to(os.getpid), rank=1)])
        handler.train(EPOCHS, max_time=1e-6, progress=False)
        steps = handler.global_step
        try:
            handler.train(EPOCHS, progress=False)
        except TrainingPreempted as exc:
            return {"steps": steps, "preempted": (exc.epoch, exc.batches)}
        return {"steps": steps}
    handler = build_deciding(best, ckpt, resume="auto")
    handler.train(EPOCHS, progress=False)
    return _outcome(handler, ckpt)


def test_two_ranks_stopped_inside_epochs_decide_as_an_uninterrupted_run(tmp_path):
    run = lambda phase: _ok(run_distributed(_deciding_body, 2, args=(str(tmp_path), phase), timeout=TIMEOUT))
    first = run("first")
    straight = first[0]["straight"]
    assert straight["stopper"]["stopped_epoch"] is not None and straight["stopped"] is True
    assert first[1]["straight"]["hash"] == straight["hash"]
    for r in first:
        assert {**r["same"], "stopped": True, "steps": None} == {**r["straight"], "steps": None}
        assert r["same"]["steps"] == 5
    # Stopped inside epoch 2 (3 steps an epoch), then inside epoch 3, by the signal rank 1 alone got.
    assert run("second") == [{"steps": 5, "preempted": (3, 4)}] * 2
    assert run("last") == [r["straight"] for r in first]


# ---------------------------------------------------------------- a run owns what it writes


def _files(directory):
    return {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir())}


class _Steps(Callback):
    def __init__(self):
        self.steps = []

    def on_batch_end(self, handler, i, loss):
        if (i + 1) % 2 == 0:  # 2 micro-batches per step
            self.steps.append(handler.global_step)


def test_a_new_run_in_a_directory_of_another_run_is_refused_and_loses_nothing(tmp_path):
    old = build(tmp_path)
    old.train(EPOCHS, progress=False)
    before = _files(tmp_path)
    assert sorted(before) == ["epoch-0003.ckpt", "epoch-0004.ckpt"]
    new = build(tmp_path)  # the same directory, resume=None: a new run
    for _ in range(2):  # a refused run stays refused
        with pytest.raises(ConfigurationError, match=r"checkpoint_dir .* holds checkpoints of another run "
                                                     r"\(epoch-0003\.ckpt, epoch-0004\.ckpt\).*resume='auto'.*"
                                                     r"overwrite=True.*another checkpoint_dir"):
            new.train(2, progress=False)
    assert (new.epoch, new.global_step) == (0, 0)
    assert _files(tmp_path) == before


def test_overwrite_starts_a_new_run_whose_checkpoints_stay_and_resume(tmp_path, straight, caplog):
    # The reported case: an earlier, longer run left epoch-0005/0006; the new run's checkpoints, its
    # preemption checkpoint too, were pruned by epoch number, and resume="auto" restored the old run.
    old = build(tmp_path)
    old.train(6, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["epoch-0005.ckpt", "epoch-0006.ckpt"]
    with pytest.raises(TrainingPreempted) as info:
        build(tmp_path, overwrite=True, callbacks=[AtStep(8, sigterm_to(os.getpid))]).train(EPOCHS, progress=False)
    assert os.path.isfile(info.value.checkpoint)  # reported as written, and there
    assert [p.name for p in list_run_checkpoints(tmp_path)] == ["epoch-0001.ckpt", "epoch-0002-batch-000004.ckpt"]
    assert sorted(os.listdir(tmp_path)) == ["epoch-0001.ckpt", "epoch-0002-batch-000004.ckpt"]  # the old run's: gone
    caplog.set_level(logging.INFO, logger="nn_handler")
    second = build(tmp_path, resume="auto")
    second.train(EPOCHS, progress=False)
    assert f"resuming from {info.value.checkpoint}" in caplog.text
    assert summary(second) == straight
    assert sorted(os.listdir(tmp_path)) == ["epoch-0003.ckpt", "epoch-0004.ckpt"]


def test_auto_resume_takes_the_newest_checkpoint_by_write_order_not_by_epoch(tmp_path, straight, caplog):
    build(tmp_path).train(EPOCHS, progress=False)  # epoch-0003, epoch-0004
    # Back to epoch 3 on purpose, then preempted 2 steps (4 batches) into epoch 4: epoch-0004.ckpt, of the
    # attempt that was abandoned, has the higher epoch number; the preemption checkpoint was written later.
    with pytest.raises(TrainingPreempted) as info:
        build(tmp_path, resume=tmp_path / "epoch-0003.ckpt",
              callbacks=[AtStep(20, sigterm_to(os.getpid))]).train(EPOCHS, progress=False)
    assert os.path.basename(info.value.checkpoint) == "epoch-0004-batch-000004.ckpt"
    assert [p.name for p in list_run_checkpoints(tmp_path)] == ["epoch-0004.ckpt", "epoch-0004-batch-000004.ckpt"]
    caplog.set_level(logging.INFO, logger="nn_handler")
    steps = _Steps()
    rerun = build(tmp_path, resume="auto", callbacks=[steps])
    rerun.train(EPOCHS, progress=False)
    assert f"resuming from {info.value.checkpoint}" in caplog.text
    assert steps.steps == [21, 22, 23, 24]  # the rest of the preempted epoch, not "nothing to do"
    assert summary(rerun) == straight


def test_pruning_deletes_only_this_runs_checkpoints_in_write_order(tmp_path):
    def write(name, run, seq):
        atomic_save({"format": FORMAT, "run": {"id": run, "seq": seq}, "model": {}}, tmp_path / name)

    write("epoch-0008.ckpt", "old", 1)
    write("epoch-0009.ckpt", "old", 2)
    write("epoch-0001.ckpt", "new", 3)
    write("epoch-0002-batch-000004.ckpt", "new", 4)
    write("epoch-0002.ckpt", "new", 5)
    assert [p.name for p in list_run_checkpoints(tmp_path)] == [
        "epoch-0008.ckpt", "epoch-0009.ckpt", "epoch-0001.ckpt", "epoch-0002-batch-000004.ckpt", "epoch-0002.ckpt"]
    removed = prune_run_checkpoints(tmp_path, 2, run_id="new")
    assert [p.name for p in removed] == ["epoch-0001.ckpt"]
    assert sorted(os.listdir(tmp_path)) == ["epoch-0002-batch-000004.ckpt", "epoch-0002.ckpt",
                                            "epoch-0008.ckpt", "epoch-0009.ckpt"]


def test_checkpoints_written_before_runs_were_recorded_still_resume_and_are_pruned(tmp_path, straight):
    build(tmp_path).train(2, progress=False)
    for path in list_run_checkpoints(tmp_path):  # as an older nn_handler wrote them: no run id, no write number
        payload = load_payload(path)
        del payload["run"]
        atomic_save(payload, path)
    with pytest.raises(ConfigurationError, match="holds checkpoints of another run"):
        build(tmp_path).train(EPOCHS, progress=False)  # a new run: refused all the same
    rerun = build(tmp_path, resume="auto")
    rerun.train(EPOCHS, progress=False)
    assert summary(rerun) == straight
    assert sorted(os.listdir(tmp_path)) == ["epoch-0003.ckpt", "epoch-0004.ckpt"]  # the older files were its own


def test_overwrite_settings_are_checked(tmp_path):
    with pytest.raises(ConfigurationError, match="overwrite=True applies to checkpoint_dir"):
        NNHandler(torch.nn.Linear(2, 1), overwrite=True)
    with pytest.raises(ConfigurationError, match="overwrite=True starts a new run.*resume='auto' continues"):
        NNHandler(torch.nn.Linear(2, 1), checkpoint_dir=tmp_path, resume="auto", overwrite=True)
    with pytest.raises(ConfigurationError, match="overwrite must be True or False, got 'yes'"):
        NNHandler(torch.nn.Linear(2, 1), checkpoint_dir=tmp_path, overwrite="yes")


# ---------------------------------------------------------------- 2 spawned gloo ranks


def _two_rank_body(rank, ckpt, mode):
    import os

    from nn_handler import ConfigurationError, TrainingPreempted
    from scripts.scale_case import EPOCHS, AtStep, build, sigterm_to, summary

    callbacks = []
    if mode == "preempt":
        # Only rank 1 gets the signal; step 4 is the 1st of epoch 2's 3 steps.
        callbacks = [AtStep(4, sigterm_to(os.getpid), rank=1)]
    with build(ckpt, resume="auto" if ckpt else None, callbacks=callbacks,
               check_every=1 if mode == "preempt" else None) as handler:
        try:
            handler.train(EPOCHS, progress=False)
        except TrainingPreempted as exc:
            return {"preempted": (exc.epoch, exc.batches, exc.code), **summary(handler)}
    result = summary(handler)
    try:  # closed: the DDP wrapper is gone, so training on would silently diverge
        handler.train(EPOCHS + 1, progress=False)
    except ConfigurationError as exc:
        result["after_close"] = str(exc)
    return result


def _ok(results):
    for rank, r in enumerate(results):
        if isinstance(r, BaseException):
            pytest.fail(f"rank {rank} raised {r!r}\n{getattr(r, 'remote_traceback', '')}")
    return results


def test_two_ranks_stop_together_when_one_gets_sigterm_and_resume_exactly(tmp_path):
    straight = _ok(run_distributed(_two_rank_body, 2, args=(None, "straight"), timeout=TIMEOUT))
    first = _ok(run_distributed(_two_rank_body, 2, args=(str(tmp_path), "preempt"), timeout=TIMEOUT))
    # Both ranks stopped after the same step (rank 0 never got the signal), and one file holds both shards.
    assert [r["preempted"] for r in first] == [(2, 2, PREEMPTED_EXIT_CODE)] * 2
    assert first[0]["global_step"] == first[1]["global_step"] == 4
    assert len(load_payload(tmp_path / "epoch-0002-batch-000002.ckpt")["partial"]["ranks"]) == 2
    second = _ok(run_distributed(_two_rank_body, 2, args=(str(tmp_path), "resume"), timeout=TIMEOUT))
    assert second == straight
    assert straight[0]["after_close"].startswith("this handler was closed")
    assert second[0]["train_loss"] == second[1]["train_loss"]


def _used_dir_body(rank, ckpt, overwrite):
    from nn_handler import ConfigurationError
    from scripts.scale_case import build, summary

    with build(ckpt, **({"overwrite": True} if overwrite else {})) as handler:
        try:
            handler.train(2, progress=False)
        except ConfigurationError as exc:
            return {"refused": str(exc), "epoch": handler.epoch}
    return summary(handler)


def test_two_ranks_refuse_a_directory_of_another_run_together_or_take_it_over(tmp_path):
    build(tmp_path).train(3, progress=False)
    before = _files(tmp_path)
    refused = _ok(run_distributed(_used_dir_body, 2, args=(str(tmp_path), False), timeout=TIMEOUT))
    for r in refused:  # every rank, not only rank 0 that looked: none trains on alone
        assert "holds checkpoints of another run" in r.get("refused", ""), r
        assert r["epoch"] == 0
    assert _files(tmp_path) == before
    taken = _ok(run_distributed(_used_dir_body, 2, args=(str(tmp_path), True), timeout=TIMEOUT))
    assert [(r["rank"], r["epoch"]) for r in taken] == [(0, 2), (1, 2)]
    assert sorted(os.listdir(tmp_path)) == ["epoch-0001.ckpt", "epoch-0002.ckpt"]
    assert load_payload(tmp_path / "epoch-0002.ckpt")["world_size"] == 2


# ---------------------------------------------------------------- the pieces, without training


def test_signal_catcher_puts_the_previous_handler_back_and_redelivers_an_unhandled_signal():
    from nn_handler._training.preemption import SignalCatcher

    calls = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        with SignalCatcher() as handled:
            os.kill(os.getpid(), signal.SIGTERM)
            handled.handled = True  # became a checkpoint: nothing left to deliver
        assert calls == []
        with SignalCatcher() as unhandled:
            os.kill(os.getpid(), signal.SIGTERM)
            assert calls == []  # caught while inside
        # Training ended without saving for it: the script's handler gets it after all.
        assert unhandled.received == signal.SIGTERM and calls == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)


def test_signal_catcher_outside_the_main_thread_installs_nothing():
    import threading

    from nn_handler._training.preemption import SignalCatcher

    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def body():
        with SignalCatcher():
            seen.append(signal.getsignal(signal.SIGTERM))

    t = threading.Thread(target=body)
    t.start()
    t.join(10)
    assert seen == [before]


def test_a_peer_failure_waits_only_under_torchrun(monkeypatch):
    import nn_handler._training.loop as T

    slept = []
    monkeypatch.setattr(T.time, "sleep", slept.append)
    peer = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242")
    torchrun = {"TORCHELASTIC_RUN_ID": "job"}
    assert T.wait_if_peer_failed(peer, torchrun) and slept == [T.PEER_FAILURE_GRACE_S]
    assert not T.wait_if_peer_failed(ValueError("bad batch"), torchrun)  # a root cause reports at once
    assert not T.wait_if_peer_failed(peer, {})  # no torchrun summary to protect
    assert slept == [T.PEER_FAILURE_GRACE_S]

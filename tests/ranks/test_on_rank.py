"""on_rank, main_process_first, any_rank/all_ranks and RankFailedError.

Unit tests first (no processes), then real gloo groups through
run_distributed; each rank body runs several scenarios in sequence, which
also shows that the ranks' collectives stay aligned after every failure.
"""

from __future__ import annotations

import pickle
import re
import traceback

import pytest
import torch

from nn_handler.errors import RankFailedError, RankFailure
from nn_handler.testing import RemoteFailure, run_distributed
from nn_handler.utils.ddp_decorators import all_ranks, any_rank, main_process_first, on_rank

# Limits, smallest first: the group's collective timeout < the helper's
# deadline < pytest-timeout (120 s in setup.cfg), so a hang names itself.
PG_TIMEOUT = 30
DEADLINE = 100


class DiskFullError(OSError):
    """A user's exception type, importable on every rank (module level)."""


def _failure(rank=0, exc_type="ValueError", message="bad", traceback="Traceback ...\nValueError: bad"):
    return RankFailure(rank=rank, device="cpu", pid=100 + rank, exc_type=exc_type, message=message,
                       traceback=traceback)


# ---------------------------------------------------------------- no process group


def test_without_a_group_the_function_just_runs():
    calls = []

    @on_rank(0)
    def zero(x):
        """Doc."""
        calls.append(x)
        return x * 2

    @on_rank([1, 3], barrier=True, broadcast_result=True)
    def others():
        return "ran"

    assert zero(21) == 42 and calls == [21]
    # A single process stands for every rank, even ranks a real job would have.
    assert others() == "ran"
    assert zero.__name__ == "zero" and zero.__doc__ == "Doc." and zero.__wrapped__(1) == 2


@pytest.mark.parametrize(
    "rank, message",
    [([], "list of ranks is empty"), ((), "list of ranks is empty"), ("0", "got str '0'"),
     (1.0, "got float 1.0"), (None, "got NoneType None"), (True, "got bool True"), ([0, False], "got bool False"),
     ([0, "1"], "got str '1'"), (-1, "got -1"), ([0, -2], "got -2"), (range(-1, 2), "got -1")],
)
def test_bad_rank_raises_value_error_at_decoration(rank, message):
    # Nothing here depends on the world size, so it need not wait for the call (or for a process group).
    with pytest.raises(ValueError, match=message) as info:
        @on_rank(rank)
        def save():
            return "ran"
    assert "on_rank(" in str(info.value)
    if message.startswith("got -"):
        assert "a rank is never negative" in str(info.value)


LAUNCHED = {"torchrun": {"RANK": "1", "WORLD_SIZE": "2"},
            "srun": {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "5"},
            "mpirun": {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}}


@pytest.fixture
def launched(monkeypatch, request):
    """Rank 1 of 2 as a launcher sets it, before any process group exists (before initialize_ddp)."""
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in LAUNCHED[request.param].items():
        monkeypatch.setenv(name, value)
    return monkeypatch


@pytest.mark.parametrize("launched", list(LAUNCHED), indirect=True)
def test_before_the_group_exists_the_launch_rank_decides(launched):
    ran = []

    @on_rank(0)
    def save():
        ran.append("save")
        return "saved"

    @on_rank([0, 1])
    def both():
        return "both"

    @on_rank(1)
    def mine():
        inner = on_rank(0)(lambda: "inner")()  # nested: the same rule
        return f"rank 1 ran, inner {inner}"

    assert save() is None and ran == []  # rank 1 does not save what rank 0 saves
    assert both() == "both" and mine() == "rank 1 ran, inner None"
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\) \(the world size is 2\), got 2"):
        on_rank(2)(lambda: "ran")()


@pytest.mark.parametrize("launched", ["torchrun"], indirect=True)
def test_before_the_group_exists_rank_zero_runs(launched):
    launched.setenv("RANK", "0")
    assert on_rank(0)(lambda: "saved")() == "saved"
    assert on_rank(1)(lambda: "ran")() is None


@pytest.mark.parametrize("launched", ["torchrun"], indirect=True)
def test_before_the_group_exists_what_needs_the_other_ranks_refuses(launched):
    """Ranks cannot wait for each other or agree without a group: a clear error, not a silent local answer."""
    calls = [
        (lambda: on_rank(0, broadcast_result=True)(lambda: 1)(), "broadcast_result=True"),
        (lambda: on_rank(1, barrier=True)(lambda: 1)(), "barrier=True"),
        (lambda: any_rank(True), "any_rank"),
        (lambda: all_ranks(True), "all_ranks"),
    ]
    for call, what in calls:
        with pytest.raises(RuntimeError, match="no process group exists yet") as info:
            call()
        assert what in str(info.value) and "rank 1 of 2 (torchrun)" in str(info.value)
        assert "call initialize_ddp()" in str(info.value)
    ran = []
    with pytest.raises(RuntimeError, match="main_process_first needs a process group"):
        with main_process_first():
            ran.append(1)
    assert ran == []


def test_a_wrong_launch_environment_is_not_taken_for_a_single_process(monkeypatch):
    from nn_handler.errors import LaunchEnvironmentError

    monkeypatch.setenv("RANK", "")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(LaunchEnvironmentError, match="RANK must be an integer, got ''"):
        on_rank(0)(lambda: "ran")()


def test_a_plain_process_in_an_allocation_still_stands_for_every_rank(monkeypatch):
    # `python train.py` in an sbatch script (no srun): one process, as without a launcher.
    for name, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "5"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS", raising=False)
    assert on_rank([1, 3], broadcast_result=True)(lambda: "ran")() == "ran"
    assert any_rank(True) is True
    with main_process_first():
        pass


_SAVE_ON_RANK_ZERO = """
import sys
from pathlib import Path
from nn_handler import on_rank

@on_rank(0)
def save(directory):
    Path(directory, f"saved-by-rank-{sys.argv[2]}").write_text("x")

save(sys.argv[1])
"""


def test_two_launched_processes_without_a_group_save_once(tmp_path):
    # torchrun's environment, before initialize_ddp: each process calls the @on_rank(0) function.
    import os
    import subprocess
    import sys

    from helpers import LAUNCH_VARS

    procs = []
    try:
        for rank in (0, 1):
            env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
            env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
            procs.append(subprocess.Popen([sys.executable, "-c", _SAVE_ON_RANK_ZERO, str(tmp_path), str(rank)],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert sorted(f.name for f in tmp_path.iterdir()) == ["saved-by-rank-0"]


def test_bare_decorator_is_a_clear_error():
    with pytest.raises(ValueError, match=r"write @on_rank\(0\), not @on_rank"):
        @on_rank
        def f():
            pass


def test_any_all_ranks_without_a_group():
    assert any_rank(True) is True and any_rank(0) is False
    assert all_ranks(1) is True and all_ranks(False) is False
    assert any_rank(torch.tensor(True)) is True and all_ranks(torch.isnan(torch.tensor(1.0))) is False


def test_main_process_first_without_a_group():
    ran = []
    with main_process_first():
        ran.append(1)
    assert ran == [1]
    with pytest.raises(KeyError, match="mine"):  # the block's own error, unchanged
        with main_process_first():
            raise KeyError("mine")


# ---------------------------------------------------------------- RankFailedError (no processes)


def test_rank_failed_error_is_also_the_original_type():
    err = RankFailedError.create("save", [_failure(1)], ValueError)
    assert isinstance(err, RankFailedError) and isinstance(err, ValueError) and isinstance(err, RuntimeError)
    assert type(err).__name__ == "RankFailedError[ValueError]" and err.original_type is ValueError
    assert err.ranks == (1,) and err.function == "save"
    assert str(err) == "save failed on rank 1 (cpu, pid 101): ValueError: bad"  # the traceback is its cause
    assert err.__cause__.tb == "Traceback ...\nValueError: bad"
    # One class per original type.
    assert type(RankFailedError.create("other", [_failure()], ValueError)) is type(err)


def test_rank_failed_error_renders_several_ranks_in_rank_order():
    err = RankFailedError.create("step", [_failure(2, "KeyError", "'k'"), _failure(0)], ValueError)
    lines = str(err).splitlines()
    assert lines[0] == "step failed on ranks 0, 2:"
    assert lines[1] == "  step failed on rank 0 (cpu, pid 100): ValueError: bad"
    assert lines[2] == "  step failed on rank 2 (cpu, pid 102): KeyError: 'k'"
    assert err.ranks == (0, 2)


def test_key_error_text_is_not_quoted():
    # KeyError's own __str__ would render the whole text as one repr'd line.
    err = RankFailedError.create("f", [_failure(exc_type="KeyError", message="'k'")], KeyError)
    assert isinstance(err, KeyError) and str(err) == "f failed on rank 0 (cpu, pid 100): KeyError: 'k'"
    two = RankFailedError.create("f", [_failure(exc_type="KeyError", message="'k'"), _failure(1)], KeyError)
    assert str(two).startswith("f failed on ranks 0, 1:\n") and "--- traceback of rank 1 ---" in str(two)


@pytest.mark.parametrize("exc_type", [ValueError, KeyError, DiskFullError, FileNotFoundError, UnicodeDecodeError,
                                      NotImplementedError, None])
def test_rank_failed_error_pickles(exc_type):
    err = RankFailedError.create("save", [_failure(0), _failure(1)], exc_type)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err)
    assert back.failures == err.failures and back.function == "save"


def test_unimportable_type_falls_back_to_its_nearest_importable_base():
    class LocalError(KeyError):  # defined in a function: cannot be pickled by name
        pass

    err = RankFailedError.create("f", [_failure()], LocalError)
    assert isinstance(err, LocalError)  # in this process the type itself is known
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, KeyError) and not isinstance(back, LocalError)
    assert type(back).__name__ == "RankFailedError[KeyError]"


class _StrictNew(RuntimeError):
    # A RuntimeError subclass sits before RuntimeError in the combined class's
    # MRO, so its __new__ does receive our arguments, and rejects them.
    def __new__(cls, code: int):
        if not isinstance(code, int):
            raise TypeError("code must be an int")
        return super().__new__(cls, code)


class _NoSubclasses(ValueError):
    def __init_subclass__(cls, **kwargs):
        raise TypeError("final")


@pytest.mark.parametrize(
    "exc_type", [_StrictNew, _NoSubclasses, KeyboardInterrupt, SystemExit, RuntimeError, Exception, int, "x"]
)
def test_types_that_cannot_or_need_not_be_combined_give_a_plain_error(exc_type):
    err = RankFailedError.create("f", [_failure()], exc_type)
    assert type(err) is RankFailedError
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


def test_a_relayed_rank_failed_error_keeps_the_root_type():
    inner = RankFailedError.create("inner", [_failure()], ValueError)
    outer = RankFailedError.create("outer", [_failure(1)], type(inner))
    assert type(outer) is type(inner)


def _formatted(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


@pytest.mark.parametrize("exc_type", [ValueError, None])
def test_the_remote_traceback_is_the_cause(exc_type):
    remote = 'Traceback (most recent call last):\n  File "train.py", line 3, in save\n    raise ValueError("bad")\nValueError: bad\n'
    err = RankFailedError.create("save", [_failure(1, traceback=remote)], exc_type)
    for e in (err, pickle.loads(pickle.dumps(err))):  # rebuilt with its cause on the receiving side too
        try:
            raise e
        except RankFailedError as caught:
            text = _formatted(caught)
        assert "The above exception was the direct cause of the following exception" in text
        cause, _, own = text.partition("direct cause")
        assert 'File "train.py", line 3, in save' in cause and "RemoteTraceback" in cause
        assert own.count("RankFailedError") >= 1 and str(e) == str(err)


# ---------------------------------------------------------------- real gloo groups


def _happy_paths(rank):
    """2 ranks, group made after decorating (targets are decided at call time)."""
    from datetime import timedelta

    import torch.distributed as dist

    from nn_handler.utils import _collectives
    from nn_handler.utils.ddp import initialize_ddp

    log = []

    @on_rank(0)
    def zero(x):
        log.append(("zero", x))
        return f"zero got {x}"

    @on_rank([1], broadcast_result=True)
    def from_one():
        return {"made on": dist.get_rank(), "tensor": torch.arange(3)}

    @on_rank([0, 1], barrier=True)
    def both():
        return dist.get_rank()

    @on_rank(0, broadcast_result=True)
    def nested():
        inner = on_rank(0)(lambda: "inner ran")()  # runs locally: no exchange inside restricted code
        skipped = on_rank(1)(lambda: "never")()
        try:
            any_rank(True)
            collective = "no error"
        except RuntimeError as exc:
            collective = str(exc)
        return inner, skipped, collective

    initialize_ddp(timeout=PG_TIMEOUT, backend="gloo")
    out = {
        "zero": zero(7),
        "from_one": from_one(),
        "both": both(),
        "nested": nested(),
        "any": (any_rank(rank == 1), any_rank(False)),
        "all": (all_ranks(rank == 1), all_ranks(True)),
        "log": log,
        "same side group": _collectives.side_group() is _collectives.side_group(),
    }
    # Last, as it leaves the group unusable: a barrier that rank 1 never
    # reaches names rank 1 (gloo's monitored_barrier), not a bare timeout.
    side = _collectives.side_group()
    if rank == 0:
        try:
            _collectives.monitored_barrier(side, timeout=timedelta(seconds=3))
            out["barrier"] = "passed"
        except RuntimeError as exc:
            out["barrier"] = str(exc)
    else:
        import time

        time.sleep(6)  # alive but absent: rank 0's barrier times out meanwhile
    return out


def test_happy_paths_and_a_barrier_that_names_the_missing_rank():
    r0, r1 = run_distributed(_happy_paths, nprocs=2, init=False, timeout=DEADLINE)
    assert r0["zero"] == "zero got 7" and r1["zero"] is None
    assert r0["log"] == [("zero", 7)] and r1["log"] == []
    for r in (r0, r1):
        assert r["from_one"]["made on"] == 1 and r["from_one"]["tensor"].tolist() == [0, 1, 2]
        assert r["nested"][:2] == ("inner ran", None)
        assert "inside an on_rank function" in r["nested"][2]
        assert r["any"] == (True, False) and r["all"] == (False, True)
        assert r["same side group"]
    assert (r0["both"], r1["both"]) == (0, 1)
    assert re.search(r"Ranks? 1 failed to pass monitoredBarrier", r0["barrier"]), r0["barrier"]


def _caught(fn):
    """Call fn; describe what it raised in plain picklable data."""
    try:
        return ("returned", fn())
    except BaseException as exc:  # noqa: BLE001
        return ("raised", type(exc).__name__, [c.__name__ for c in type(exc).__mro__], str(exc),
                getattr(exc, "ranks", None))


def _failures(rank, world):
    """Failure scenarios in sequence on 2 or 3 ranks; every rank must see every failure."""
    last = world - 1

    @on_rank(0)
    def fails_on_zero():
        raise ValueError("bad value on zero")

    @on_rank(last, barrier=True)
    def fails_on_last_with_barrier():
        raise DiskFullError(28, "no space left for the checkpoint")

    @on_rank([0, last])
    def fails_on_both():
        raise KeyError(f"key{rank}")

    @on_rank([0, last])
    def fails_on_last_only():
        if rank == last:
            raise LookupError("only the last one")
        return "fine"

    @on_rank(last, broadcast_result=True)
    def broadcast_then_fail():
        raise ZeroDivisionError("in broadcast")

    @on_rank(0, broadcast_result=True)
    def unpicklable_result():
        import threading

        return threading.Lock()

    @on_rank(world)
    def out_of_range():
        return "ran"

    @on_rank(last, broadcast_result=True)
    def still_aligned():
        return f"hello from {rank}"

    def except_value_error():
        try:
            fails_on_zero()
        except ValueError:
            return "caught as ValueError"

    def zero_formatted():
        try:
            fails_on_zero()
        except ValueError as exc:
            return "".join(traceback.format_exception(exc))

    return {
        "zero": _caught(fails_on_zero),
        "zero formatted": zero_formatted(),
        "except": _caught(except_value_error),
        "last": _caught(fails_on_last_with_barrier),
        "both": _caught(fails_on_both),
        "last only": _caught(fails_on_last_only),
        "broadcast": _caught(broadcast_then_fail),
        "unpicklable": _caught(unpicklable_result),
        "out of range": _caught(out_of_range),
        "aligned": _caught(still_aligned),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_a_failure_raises_on_every_rank(world):
    results = run_distributed(_failures, nprocs=world, args=(world,), timeout=DEADLINE, pg_timeout=PG_TIMEOUT)
    last = world - 1
    for rank, r in enumerate(results):
        assert not isinstance(r, BaseException), getattr(r, "remote_traceback", r)

        kind, name, mro, text, ranks = r["zero"]
        assert kind == "raised" and "ValueError" in mro
        if rank == 0:
            assert (name, text) == ("ValueError", "bad value on zero")  # its own exception
        else:
            assert name == "RankFailedError[ValueError]" and ranks == (0,)
            assert text.startswith("_failures.<locals>.fails_on_zero failed on rank 0 (cpu, pid ")
            assert "ValueError: bad value on zero" in text
            assert 'raise ValueError("bad value on zero")' not in text  # the remote traceback is the cause alone
            cause, _, own = r["zero formatted"].partition("The above exception was the direct cause")
            assert 'raise ValueError("bad value on zero")' in cause and "RemoteTraceback" in cause, r["zero formatted"]
            assert 'raise ValueError("bad value on zero")' not in own  # printed once
        assert r["except"] == ("returned", "caught as ValueError")

        kind, name, mro, text, ranks = r["last"]
        assert "DiskFullError" in mro and "OSError" in mro
        assert (name == "DiskFullError") == (rank == last)
        assert rank == last or ranks == (last,) and "no space left" in text

        kind, name, mro, text, ranks = r["both"]
        assert "KeyError" in mro
        if rank in (0, last):
            assert name == "KeyError" and text == f"'key{rank}'"
        else:
            assert ranks == (0, last) and "'key0'" in text and f"'key{last}'" in text

        kind, name, mro, text, ranks = r["last only"]
        assert kind == "raised" and "LookupError" in mro  # rank 0 succeeded, yet raises too
        assert rank == last or ranks == (last,)

        assert "ZeroDivisionError" in r["broadcast"][2]

        kind, name, mro, text, ranks = r["unpicklable"]
        assert "TypeError" in mro and "cannot be pickled" in text and "broadcast_result=True" in text

        kind, name, mro, text, ranks = r["out of range"]
        assert name == "ValueError" and f"rank must be in [0, {world})" in text and str(world) in text

        assert r["aligned"] == ("returned", f"hello from {last}")


def _main_first(rank, shared_dir):
    import time
    from pathlib import Path

    shared = Path(shared_dir)
    out = {}

    # Ordering: rank 0 writes, the others read; rank 0 leaves after they did.
    with main_process_first():
        if rank == 0:
            time.sleep(0.5)  # were the others not waiting, they would find no file
            (shared / "data.txt").write_text("preprocessed")
        else:
            out["read"] = (shared / "data.txt").read_text()
            (shared / f"seen{rank}").touch()
    out["markers after"] = sorted(p.name for p in shared.glob("seen*"))

    ran_block = []

    def rank_zero_fails():
        with main_process_first():
            ran_block.append(rank)
            if rank == 0:
                raise FileNotFoundError("download failed")

    def rank_one_fails():
        with main_process_first():
            if rank == 1:
                raise ValueError("bad cache on one")

    def nested_in_on_rank():
        @on_rank(0)
        def f():
            with main_process_first():
                pass

        f()

    out["zero fails"] = _caught(rank_zero_fails)
    out["ran block"] = ran_block
    out["one fails"] = _caught(rank_one_fails)
    out["nested"] = _caught(nested_in_on_rank)
    out["aligned"] = any_rank(rank == 2)
    return out


def test_main_process_first_orders_and_fails_together(tmp_path):
    results = run_distributed(_main_first, nprocs=3, args=(str(tmp_path),), timeout=DEADLINE,
                              pg_timeout=PG_TIMEOUT)
    for rank, r in enumerate(results):
        assert not isinstance(r, BaseException), getattr(r, "remote_traceback", r)
        if rank:
            assert r["read"] == "preprocessed"
        if rank == 0:
            assert r["markers after"] == ["seen1", "seen2"]

        kind, name, mro, text, ranks = r["zero fails"]
        assert "FileNotFoundError" in mro
        if rank == 0:
            assert name == "FileNotFoundError" and r["ran block"] == [0]
        else:
            assert ranks == (0,) and "download failed" in text
            assert r["ran block"] == []  # they raised instead of running their block

        kind, name, mro, text, ranks = r["one fails"]
        assert "ValueError" in mro  # rank 0 (already past its block) and rank 2 too
        assert rank == 1 and name == "ValueError" or ranks == (1,)

        kind, name, mro, text, ranks = r["nested"]
        assert "RuntimeError" in mro and "main_process_first" in text
        assert r["aligned"] is True


def _dies(rank):
    import os

    @on_rank(1)
    def crash():
        os._exit(3)

    try:
        crash()
    except RuntimeError as exc:
        return str(exc), getattr(exc, "__notes__", [])
    return "returned"


def test_a_rank_that_dies_does_not_leave_the_others_waiting():
    # The group's timeout is far beyond the deadline: rank 0 must learn of
    # the death from the closed connection, not from a timeout.
    r0, r1 = run_distributed(_dies, nprocs=2, timeout=DEADLINE, pg_timeout=3600)
    assert isinstance(r1, RemoteFailure) and "exitcode 3" in str(r1)
    message, notes = r0
    assert any("exchanged the status of _dies.<locals>.crash" in n for n in notes), r0


@pytest.mark.slow
def test_torchrun_checkpoint_then_failure_on_rank_zero_ends_both_ranks(tmp_path):
    import sys

    from helpers import parse_results, run_command
    from nn_handler.utils.ddp import find_free_port

    checkpoint = tmp_path / "model.pt"
    result = run_command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--master_port={find_free_port()}", "tests/scripts/on_rank_checkpoint.py", str(checkpoint)],
                         timeout=DEADLINE)
    assert result.returncode != 0, result.stdout[-3000:]
    rows = parse_results(result.stdout)
    assert [r["rank"] for r in rows] == [0, 1], result.stdout[-3000:]
    zero, one = rows
    assert zero["error"] == "OSError" and "could not upload" in zero["first_line"]
    assert one["error"] == "RankFailedError[OSError]" and one["is_oserror"]
    assert one["first_line"].startswith("save_checkpoint failed on rank 0 (cpu, pid ")
    assert "could not upload" in one["first_line"]
    # Each rank printed rank 0's traceback once: rank 0 its own, rank 1 as its error's cause.
    assert result.stdout.count('raise OSError(f"could not upload {target} after saving it")') == 2, result.stdout
    saved = torch.load(checkpoint, weights_only=True)  # written before the failure, complete
    assert set(saved["model"]) == {"weight", "bias"} and saved["world_size"] == 2


# ---------------------------------------------------------------- collectives inside the function


def _outcome(call):
    """What one rank got from ``call()``: ``("ok", value)`` or ``(exception type, first line)``."""
    try:
        return "ok", call()
    except Exception as exc:  # noqa: BLE001 - what each rank raised, as plain data
        return type(exc).__name__, str(exc).splitlines()[0]


def _guarded_collectives(rank):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as functional

    t = torch.ones(2)
    calls = {  # only rank 0 runs them: each would wait for rank 1 forever
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(4), t),
        "all_gather_single": lambda: dist.all_gather_single(torch.empty(4), t),  # what FSDP2 calls
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(1), t),
        "send": lambda: dist.send(t, dst=1),
        "recv": lambda: dist.recv(t, src=1),
        "broadcast_object_list": lambda: dist.broadcast_object_list([rank]),
        "new_group": lambda: dist.new_group([0, 1]),
        "_functional_collectives.all_reduce": lambda: functional.all_reduce(t, "sum", dist.group.WORLD).wait(),
    }
    seen = {}
    for name, call in calls.items():
        seen[name] = _outcome(on_rank(0, debug=True)(call))

    @on_rank([0, 1], debug=True)
    def everyone():  # every rank of the job runs it: its collectives are no mistake
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)
        return float(total), any_rank(rank == 1)

    seen["on every rank"] = _outcome(everyone)
    return seen


def test_the_debug_guard_covers_every_collective_of_torch_and_lets_every_rank_meet():
    zero, one = run_distributed(_guarded_collectives, nprocs=2, timeout=DEADLINE, pg_timeout=PG_TIMEOUT)
    everyone = zero.pop("on every rank"), one.pop("on every rank")
    refused = {name: kind == "RuntimeError" and f"torch.distributed.{name} was called inside" in message
               for name, (kind, message) in zero.items()}
    assert all(refused.values()), (refused, zero)
    for name, (kind, message) in zero.items():
        assert "rank 1 never join" in message
        assert one[name][0].startswith("RankFailedError"), one[name]
    assert everyone == (("ok", (3.0, True)),) * 2


def _guard_with_a_subgroup(rank):
    import torch.distributed as dist

    pair = dist.new_group([0, 1])  # every rank creates it

    @on_rank([0, 1], debug=True)
    def among_the_pair():
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, group=pair)  # ranks 0 and 1 are both here: fine
        if rank == 0:
            dist.send(t, dst=1)
        else:
            dist.recv(t, src=0)
        return float(t)

    @on_rank([0, 1], debug=True)
    def with_rank_2():
        dist.all_reduce(torch.ones(1))  # rank 2 is not here

    return _outcome(among_the_pair), _outcome(with_rank_2)


def test_the_debug_guard_refuses_only_a_collective_that_a_rank_outside_the_function_must_join():
    results = run_distributed(_guard_with_a_subgroup, nprocs=3, timeout=DEADLINE, pg_timeout=PG_TIMEOUT)
    assert [r[0] for r in results] == [("ok", 3.0), ("ok", 3.0), ("ok", None)]
    kind, message = results[0][1]
    assert kind == "RuntimeError" and "torch.distributed.all_reduce was called inside" in message
    assert "only ranks 0, 1 runs: rank 2 never join" in message
    assert results[2][1][0].startswith("RankFailedError")


def _handler_inside_on_rank(rank, strategy):
    from nn_handler import NNHandler
    from scripts.handler_case import make_data, make_model

    handler = NNHandler(make_model(), torch.optim.SGD, torch.nn.MSELoss(), optimizer_kwargs={"lr": 0.1},
                        device="cpu", strategy=strategy, stall_timeout=None)
    X, y = make_data(16)
    calls = {"save_model": lambda: handler.save_model("never.pt"),
             "export_model": lambda: handler.export_model("never.pt"),
             "save_checkpoint": lambda: handler.save_checkpoint("never.ckpt"),
             "evaluate": lambda: handler.evaluate((X, y)),
             "predict": lambda: handler.predict(X),
             "train": lambda: handler.train(1, progress=False)}  # DDP's gradient all_reduce too
    handler.set_train_loader((X, y), batch_size=8)
    if strategy == "fsdp":  # a sharded load is a collective (they stalled until stall_timeout, then rank 0 exited)
        handler.save_checkpoint("weights.ckpt")
        handler.export_model("weights.pt")
        calls.update(load_checkpoint=lambda: handler.load_checkpoint("weights.ckpt"),
                     load_model=lambda: handler.load_model("weights.pt"))
    seen = {name: _outcome(on_rank(0)(call)) for name, call in calls.items()}
    return seen, handler.evaluate((X, y))["loss"]  # after: the ranks are still in step


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_collective_handler_methods_inside_on_rank_raise_at_once_saying_to_call_them_on_every_rank(strategy, tmp_path,
                                                                                                     monkeypatch):
    # Under FSDP the gathered state and the sharded forward are collectives: they waited for
    # rank 1, which waits for the on_rank function, until the group's timeout.
    monkeypatch.chdir(tmp_path)
    (zero, after_zero), (one, after_one) = run_distributed(_handler_inside_on_rank, nprocs=2, args=(strategy,),
                                                           timeout=DEADLINE, pg_timeout=PG_TIMEOUT)
    for name, (kind, message) in zero.items():
        method = "export_model" if name == "save_model" else name
        assert kind == "RuntimeError" and f"NNHandler.{method} was called inside an on_rank function" in message, \
            (name, kind, message)
        assert "call it outside, on every rank" in message
        assert one[name][0].startswith("RankFailedError"), one[name]
    assert after_zero == after_one
    assert not list(tmp_path.glob("never*"))

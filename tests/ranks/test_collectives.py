"""run_on_ranks and agree_on_failure: "rank 0 does it, every rank agrees on failure", on 2 real gloo ranks.

One rank body runs every scenario in sequence, which also shows that the
ranks' collectives stay aligned after each failure. (on_rank and
main_process_first, built on these, are tested in test_on_rank.py; the
trainer's checkpoint paths in test_handler_dist.py and test_scaling_resume.py.)
"""

from __future__ import annotations

import pytest
import torch

from nn_handler.testing import run_distributed
from nn_handler.utils._collectives import agree_on_failure, run_on_ranks

# Limits, smallest first: the group's collective timeout < the helper's
# deadline < pytest-timeout (120 s in setup.cfg), so a hang names itself.
PG_TIMEOUT = 30
DEADLINE = 100


class QuotaError(OSError):
    """A user's exception type, importable on every rank (module level)."""


class PeerSaw(RuntimeError):
    """What the ranks that did not fail raise when the caller asks for its own error."""


def _raised(fn):
    """Call fn; describe what it raised (or returned) as plain picklable data."""
    try:
        return {"returned": fn()}
    except BaseException as exc:  # noqa: BLE001
        cause = exc.__cause__
        return {"name": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__], "text": str(exc),
                "ranks": getattr(exc, "ranks", None),
                "cause": None if cause is None else (type(cause).__name__, str(cause), getattr(cause, "ranks", None))}


def _scenarios(rank):
    from nn_handler.utils._collectives import side_group
    from nn_handler.utils.ddp_decorators import any_rank

    side = side_group()
    ran = []

    def fails_on_zero():
        ran.append("fails_on_zero")
        raise QuotaError(122, "quota exceeded writing ckpt")

    def made_here():
        ran.append("made_here")
        return {"rank": rank, "tensor": torch.arange(3)}

    def unpicklable():
        import threading

        return threading.Lock()

    def uses_a_collective():
        return any_rank(True)  # inside: not every rank runs this

    def peer_error(err):
        return PeerSaw(f"rank 0 could not do it; see rank 0's error ({type(err).__name__})")

    out = {
        "fails": _raised(lambda: run_on_ranks(side, fails_on_zero, what="save step")),
        "broadcast": _raised(lambda: run_on_ranks(side, made_here, what="plan", broadcast=True)),
        "local only": _raised(lambda: run_on_ranks(side, lambda: f"ran on {rank}", what="log")),
        "from rank 1": _raised(lambda: run_on_ranks(side, lambda: f"made on {rank}", what="pick", ranks=(1,),
                                                    broadcast=True)),
        "unpicklable": _raised(lambda: run_on_ranks(side, unpicklable, what="plan", broadcast=True)),
        "fails in broadcast call": _raised(lambda: run_on_ranks(side, fails_on_zero, what="plan",
                                                                broadcast=True)),
        "collective inside": _raised(lambda: run_on_ranks(side, uses_a_collective, what="nested")),
        "peer error": _raised(lambda: run_on_ranks(side, fails_on_zero, what="the write of x.ckpt",
                                                   peer_error=peer_error)),
        # Every rank did its part; rank 1's failed.
        "agree, one failed": _raised(lambda: agree_on_failure(
            side, "load", ValueError("bad file on 1") if rank == 1 else None)),
        "agree, none failed": _raised(lambda: agree_on_failure(side, "load", None, payload_size=10 + rank)),
        "aligned": _raised(lambda: run_on_ranks(side, lambda: "still in step", what="last", broadcast=True)),
    }
    out["ran"] = ran
    return out


def test_run_on_ranks_and_agree_on_failure_on_two_ranks():
    r0, r1 = run_distributed(_scenarios, nprocs=2, timeout=DEADLINE, pg_timeout=PG_TIMEOUT)
    for r in (r0, r1):
        assert not isinstance(r, BaseException), getattr(r, "remote_traceback", r)

    # A failure on rank 0: its own exception there; on rank 1 a RankFailedError that is also a QuotaError.
    fails0, fails1 = r0["fails"], r1["fails"]
    assert (fails0["name"], fails0["text"]) == ("QuotaError", "[Errno 122] quota exceeded writing ckpt")
    assert fails1["name"] == "RankFailedError[QuotaError]" and fails1["ranks"] == (0,)
    assert {"RankFailedError", "QuotaError", "OSError"} <= set(fails1["mro"])
    first = fails1["text"]  # one line: rank 0's traceback is the cause (printed above it), not repeated here
    assert first.startswith("save step failed on rank 0 (cpu, pid ") and "\n" not in first
    assert first.endswith("): QuotaError: [Errno 122] quota exceeded writing ckpt")
    # The remote traceback starts at the function, not inside the helper.
    name, remote, _ = fails1["cause"]
    assert name == "RemoteTraceback" and remote.startswith('\n"""\nTraceback (most recent call last):\n')
    assert "nn_handler/utils" not in remote and 'raise QuotaError(122, "quota exceeded writing ckpt")' in remote

    # Success: rank 0's result on every rank with broadcast; without, the others get None and skip fn.
    for r in (r0, r1):
        made = r["broadcast"]["returned"]
        assert made["rank"] == 0 and made["tensor"].tolist() == [0, 1, 2]
        assert r["from rank 1"] == {"returned": "made on 1"}
        assert r["aligned"] == {"returned": "still in step"}
    assert (r0["local only"], r1["local only"]) == ({"returned": "ran on 0"}, {"returned": None})
    assert r0["ran"] == ["fails_on_zero", "made_here", "fails_on_zero", "fails_on_zero"] and r1["ran"] == []

    # Failure in the broadcast path: an unpicklable result fails on rank 0 and reaches rank 1 alike.
    bad0, bad1 = r0["unpicklable"], r1["unpicklable"]
    assert bad0["name"] == "TypeError" and "cannot be pickled" in bad0["text"]
    assert bad1["name"] == "RankFailedError[TypeError]" and bad1["ranks"] == (0,)
    assert "cannot be pickled" in bad1["text"]
    # ... and a function that raises when its result was to be broadcast.
    assert r0["fails in broadcast call"]["name"] == "QuotaError"
    assert r1["fails in broadcast call"]["name"] == "RankFailedError[QuotaError]"

    # A collective inside fn is refused on rank 0 (instead of hanging), and rank 1 learns of it.
    inside0, inside1 = r0["collective inside"], r1["collective inside"]
    assert inside0["name"] == "RuntimeError" and "any_rank was called inside an on_rank function" in inside0["text"]
    assert inside1["name"] == "RankFailedError" and inside1["ranks"] == (0,)

    # The caller's own error for the others, with the RankFailedError (rank 0's traceback) as its cause.
    assert r0["peer error"]["name"] == "QuotaError" and r0["peer error"]["cause"] is None
    peer = r1["peer error"]
    assert (peer["name"], peer["text"]) == ("PeerSaw", "rank 0 could not do it; see rank 0's error "
                                                       "(RankFailedError[QuotaError])")
    name, text, ranks = peer["cause"]
    assert name == "RankFailedError[QuotaError]" and ranks == (0,)
    assert text.startswith("the write of x.ckpt failed on rank 0 (cpu, pid ")

    # agree_on_failure: every rank took part; the failed one raises its own, the others a RankFailedError.
    assert (r1["agree, one failed"]["name"], r1["agree, one failed"]["text"]) == ("ValueError", "bad file on 1")
    other = r0["agree, one failed"]
    assert other["name"] == "RankFailedError[ValueError]" and other["ranks"] == (1,)
    assert other["text"].startswith("load failed on rank 1 (cpu, pid ")
    for r in (r0, r1):
        assert r["agree, none failed"] == {"returned": 21}  # the payload sizes, summed

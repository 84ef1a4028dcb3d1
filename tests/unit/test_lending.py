"""The caller's record of the result files a worker lends it: what goes back, what is let go, what stays open."""

from __future__ import annotations

import os

import torch

from nn_handler.utils._workers import lending


def _open_in(directory) -> int:
    """Descriptors this process holds on files that were in ``directory``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory))
        except OSError:
            pass
    return count


def _receive(owner: str, key: str, nbytes: int = 4096):
    """What the caller does with a result's file: open (the name goes), map, track; the storage."""
    fd = lending.open_result(owner, key)
    storage = torch.UntypedStorage.from_file(lending.fd_path(fd), shared=True, nbytes=nbytes)
    lending.track(owner, key, fd, nbytes, storage)
    return storage


def test_settle_gives_back_what_torch_freed_and_bounds_what_it_keeps(tmp_path, monkeypatch):
    monkeypatch.setattr(lending, "TRACKED_RESULTS", 3)
    monkeypatch.setattr(lending, "SPARE_FILES", 2)
    owner = f"{tmp_path}/w0.1-"
    keys = [f"{owner}{i}" for i in range(5)]
    for key in keys:
        with open(key, "wb") as f:
            f.write(b"\0" * 4096)
    in_use = [_receive(owner, key) for key in keys]
    assert os.listdir(tmp_path) == []  # names go at once; the files stay open here
    assert _open_in(tmp_path) == 5

    # All five in use: none goes back, and the two oldest are let go (still valid, no longer tracked).
    assert lending.settle(owner) == ([], keys[:2])
    assert _open_in(tmp_path) == 3
    in_use[0][0] = 7
    assert in_use[0][0] == 7

    # A view keeps a storage in use; once every tensor of the others is gone, they go back, two at most.
    view = torch.empty(0, dtype=torch.uint8).set_(in_use[2], 0, (8,))
    del in_use[2:]
    assert lending.settle(owner) == ([keys[3], keys[4]], [])
    del view
    assert lending.settle(owner) == ([keys[2]], [keys[3]])  # the oldest spare makes room

    # The worker wrote a result into a spare again: it is opened through the descriptor kept, with no name.
    again = _receive(owner, keys[4])
    assert again.nbytes() == 4096 and _open_in(tmp_path) == 2
    assert lending.settle(owner) == ([], [])
    lending.forget(owner)  # the worker is gone
    assert _open_in(tmp_path) == 0
    again[0] = 1  # what was mapped stays valid
    assert again[0] == 1

"""Launched by torchrun in tests/ranks/test_on_rank.py: save a checkpoint from @on_rank(0), then fail in it.

Every rank prints what it raised (a flat ``RESULT {json}`` line) and re-raises,
so the job ends with a non-zero exit and the error text from both ranks.
"""
import json
import sys

import torch

from nn_handler.utils.ddp import initialize_ddp
from nn_handler.utils.ddp_decorators import on_rank

path = sys.argv[1]
# 30 s: far below the test's deadline, so a hang would end in a named gloo timeout first.
_, rank, _, world_size, _ = initialize_ddp(timeout=30)
model = torch.nn.Linear(3, 2)


@on_rank(0)
def save_checkpoint(target):
    torch.save({"model": model.state_dict(), "world_size": world_size}, target)
    raise OSError(f"could not upload {target} after saving it")


try:
    save_checkpoint(path)
except Exception as exc:
    print("RESULT " + json.dumps({"rank": rank, "error": type(exc).__name__, "is_oserror": isinstance(exc, OSError),
                                  "first_line": str(exc).splitlines()[0]}), flush=True)
    raise

"""NNHandler on the shared regression case; prints RESULT {json} per rank (History and final weights).

    torchrun --nproc_per_node=2 tests/scripts/train_compare.py GRAD_ACCUM
"""
import json
import sys

from handler_case import make_data, make_handler, make_model, weights

from nn_handler import cleanup_ddp

grad_accum = int(sys.argv[1]) if len(sys.argv) > 1 else 1
X, y = make_data(96)
Xv, yv = make_data(37, seed=1)
handler = make_handler(make_model(), grad_accum_steps=grad_accum)
handler.set_train_loader((X, y), batch_size=8)
handler.set_val_loader((Xv, yv), batch_size=8)
history = handler.train(3, progress=True)
row = {"rank": handler.rank, "world_size": handler.world_size, "weights": weights(handler.module),
       **{k: history[k] for k in ("train_loss", "train_mae", "val_loss", "val_mae", "lr")}}
print("RESULT " + json.dumps(row), flush=True)
del handler  # the DDP model goes before its process group
cleanup_ddp()

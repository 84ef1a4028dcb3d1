"""The library works with only what ``install_requires`` names: numpy and matplotlib hidden in a subprocess.

numpy is no dependency of torch nor of nn_handler, but the ``test`` extra pulls
it in (through matplotlib), so a test run in the usual venv cannot see a
library path that needs it. Here a ``sitecustomize`` on ``PYTHONPATH`` makes
both unimportable in the script and in every process it starts (workers and
ranks are fresh interpreters that run ``sitecustomize`` too).
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest
import torch

from helpers import REPO, run_command, without_extras_env

DEADLINE = 180
pytestmark = pytest.mark.timeout(DEADLINE + 60)

# Runs under the blocker; prints one "ok ..." line per hot path it checked.
SCRIPT = textwrap.dedent('''
    import os, sys
    import torch
    from torch import nn
    from nn_handler import MissingExtraError, NNHandler, ParallelExecutor, on_rank
    from nn_handler.testing import run_distributed

    SMALL, LARGE = torch.arange(10.0), torch.arange(1 << 19, dtype=torch.float64)  # 80 B and 4 MiB (> 1 MiB)


    def numpy_importable():
        try:
            import numpy  # noqa: F401
        except ImportError:
            return False
        return True


    def echo(small, large, device):
        assert not numpy_importable()
        return small * 2, large * 2, os.getpid()


    def body(rank):
        @on_rank(0, broadcast_result=True)
        def make():
            return {"from": rank, "t": torch.arange(3) + 10, "big": torch.ones(1 << 18)}
        out = make()
        return out["from"], out["t"].tolist(), float(out["big"].sum()), numpy_importable()


    def handler(**kwargs):
        return NNHandler(nn.Linear(2, 1), torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": 0.1}, seed=0,
                         **kwargs)


    def ddp_body(rank, run_dir):
        # What rides on torch's object collectives elsewhere: every one of them
        # reads its bytes with Tensor.numpy() (torch 2.13).
        @on_rank(0)
        def fail():
            raise ValueError("planned failure on rank 0")
        try:
            fail()
            message = "no error"
        except Exception as exc:  # the failure records travel to every rank
            message = str(exc)
        epochs = []
        for _ in range(2):  # resume="auto": rank 0's choice of checkpoint goes to every rank
            with handler(checkpoint_dir=run_dir, resume="auto") as h:
                h.set_train_loader((torch.randn(16, 2), torch.randn(16, 1)), batch_size=4)
                h.train(len(epochs) + 1, progress=False)  # a checkpoint per epoch: every rank's RNG state
                epochs.append(h.epoch)
                predicted = h.predict(torch.randn(10, 2), batch_size=4)  # every rank's part, gathered
        return "planned failure on rank 0" in message and "Numpy" not in message, epochs, tuple(predicted.shape)


    if __name__ == "__main__":
        assert not numpy_importable()
        with ParallelExecutor(device_ids=["cpu", "cpu"]) as ex:
            results = ex.run(echo, SMALL, LARGE)
        assert len(results) == 2 and len({pid for _, _, pid in results}) == 2
        for small, large, _ in results:
            assert torch.equal(small, SMALL * 2) and torch.equal(large, LARGE * 2)
        print("ok executor small and large tensors both ways")

        got = run_distributed(body, nprocs=2, timeout=120)
        assert got == [(0, [10, 11, 12], float(1 << 18), False)] * 2, got
        print("ok on_rank broadcast_result on 2 gloo ranks")

        run_dir = os.path.join(sys.argv[1], "ddp")
        got = run_distributed(ddp_body, nprocs=2, args=(run_dir,), timeout=150)
        assert got == [(True, [1, 2], (10, 1))] * 2, got
        print("ok on_rank failure, checkpoints, resume and predict on 2 gloo ranks")

        h = handler()
        h.set_train_loader((torch.randn(8, 2), torch.randn(8, 1)), batch_size=4)
        h.train(1, progress=False)
        path = os.path.join(sys.argv[1], "here.ckpt")
        h.save_checkpoint(path)
        expected = torch.rand(3)
        h2 = handler()
        h2.load_checkpoint(path)
        assert torch.equal(torch.rand(3), expected)  # the RNG state came back
        print("ok checkpoint save and load with RNG state")

        with_numpy = os.path.join(sys.argv[1], "with_numpy.ckpt")
        if os.path.exists(with_numpy):  # written where numpy was installed: its numpy RNG state is skipped here
            assert handler().load_checkpoint(with_numpy) == 1
            print("ok checkpoint with numpy RNG state loaded")

        try:
            h.plot_history(os.path.join(sys.argv[1], "loss.png"))
        except MissingExtraError as exc:
            assert "pip install 'nn_handler[plot]'" in str(exc), exc
            print("ok plot_history names the plot extra")

        # Prediction shards: written by nn_handler's own safetensors writer (safetensors.torch.save needs numpy).
        from nn_handler._inference.store import ShardStore, write_shard
        out_dir = os.path.join(sys.argv[1], "predictions")
        store = ShardStore.open(out_dir, identity={"n_items": 3})
        write_shard(out_dir, [2, 0], [{"v": torch.full((2,), 2.0)}, {"v": torch.zeros(2)}])
        write_shard(out_dir, [1], [{"v": torch.ones(2)}])
        assert store.finish(3).stack()["v"][:, 0].tolist() == [0.0, 1.0, 2.0]
        from nn_handler._inference.sources import fingerprint  # a rerun's check of its data reads tensor bytes
        assert fingerprint([torch.arange(4)]) != fingerprint([torch.arange(1, 5)])
        print("ok prediction shards written and read")
''')


def test_hot_paths_work_without_numpy_and_matplotlib(tmp_path):
    from nn_handler import NNHandler

    expected = ["ok executor small and large tensors both ways", "ok on_rank broadcast_result on 2 gloo ranks",
                "ok on_rank failure, checkpoints, resume and predict on 2 gloo ranks",
                "ok checkpoint save and load with RNG state", "ok plot_history names the plot extra",
                "ok prediction shards written and read"]
    if importlib.util.find_spec("numpy") is not None:  # a checkpoint that carries numpy's RNG state
        with NNHandler(torch.nn.Linear(2, 1), torch.optim.SGD, torch.nn.MSELoss(), optimizer_kwargs={"lr": 0.1},
                       seed=0) as h:
            h.set_train_loader((torch.randn(8, 2), torch.randn(8, 1)), batch_size=4)
            h.train(1, progress=False)
            h.save_checkpoint(tmp_path / "with_numpy.ckpt")
        assert "numpy" in torch.load(tmp_path / "with_numpy.ckpt", weights_only=True)["rng"][0]
        expected.append("ok checkpoint with numpy RNG state loaded")

    script = tmp_path / "fresh.py"
    script.write_text(SCRIPT)
    result = run_command([sys.executable, str(script), str(tmp_path)],
                         timeout=DEADLINE, env=without_extras_env(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-4000:]
    for line in expected:
        assert line in result.stdout, result.stdout[-4000:]


def test_the_blocker_hides_numpy_and_matplotlib(tmp_path):
    code = ("import importlib\n"
            "for name in ('numpy', 'matplotlib', 'numpy.random'):\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except ImportError as exc:\n"
            "        print('hidden', name)\n"
            "import torch; print('torch', torch.__version__)\n")
    result = run_command([sys.executable, "-c", code], timeout=60, env=without_extras_env(tmp_path))
    assert result.returncode == 0, result.stdout
    assert result.stdout.count("hidden ") == 3 and "torch " in result.stdout, result.stdout

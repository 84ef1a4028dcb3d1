"""The package's shape: an import graph without cycles, a light worker child, and every public name kept.

The graph is read from the source with ``ast`` (nothing is run). What importing
a module loads counts the imports it runs when it is imported: those at module
level, in ``if``/``try`` blocks and class bodies; imports inside functions run
on first use, the way to defer a heavy dependency, so they are left out there.
Cycles count them too: a lazy import that closes a circle still makes two
modules that know each other. Imports under ``if TYPE_CHECKING:`` count for
cycles (a type checker follows them) but not for what a module loads at run time.
"""

from __future__ import annotations

import ast
import importlib
import json
import sys
from pathlib import Path

import pytest

from helpers import REPO, run_command

PACKAGE = REPO / "nn_handler"

# Loaded only by the trainer and the model helpers: a worker child needs none of them.
NOT_IN_A_WORKER = {
    "nn_handler.handler",
    "nn_handler.callbacks",
    "nn_handler.loggers",
    "nn_handler._tracking",
    "nn_handler._tracking.values",
    "nn_handler._tracking.run",
    "nn_handler._tracking.sender",
    "nn_handler._tracking.csv_files",
    "nn_handler._tracking.mlflow_logger",
    "nn_handler._tracking.wandb_logger",
    "nn_handler.checkpoint",
    "nn_handler.history",
    "nn_handler._training",
    "nn_handler._training.config",
    "nn_handler._training.state",
    "nn_handler._training.parts",
    "nn_handler._training.data",
    "nn_handler._training.step",
    "nn_handler._training.context",
    "nn_handler._training.loop",
    "nn_handler._training.metrics",
    "nn_handler._training.evaluation",
    "nn_handler._training.resume",
    "nn_handler._training.preemption",
    "nn_handler._training.progress",
    "nn_handler._training.precision",
    "nn_handler._training.readout",
    "nn_handler._training.schedule",
    "nn_handler._training.report",
    "nn_handler._training.hooks",
    "nn_handler.seeding",
    "nn_handler.utils._models.wrap",
    "nn_handler.utils._models.data_parallel",
    "nn_handler.utils._models.predict",
    "nn_handler.utils._models.placement",
    "nn_handler.utils._models.reports",
}


# The worker pool sits below the trainer and the model helpers: it never imports them, not even lazily.
WORKERS = "nn_handler.utils._workers"
NOT_FOR_WORKERS = ("nn_handler._training", "nn_handler.handler", "nn_handler.callbacks", "nn_handler.loggers",
                   "nn_handler._tracking", "nn_handler.utils._models")
# All of ours that a worker child may load: the worker loop, its transport, the errors, and the packages above.
WORKER_CHILD = {"nn_handler", "nn_handler.utils", "nn_handler.utils._workers", "nn_handler.errors",
                "nn_handler._failure_record",  # the errors' per-rank record
                "nn_handler.utils._workers.worker", "nn_handler.utils._workers.transport",
                "nn_handler.utils._workers.lending",  # the transport's result files
                "nn_handler.utils._workers.shm_files",  # where the transport's files live, who removes them
                "nn_handler.utils._workers.tensor_bytes",  # the transport's small tensors, as bytes
                "nn_handler.utils._workers.pickler",  # cloudpickle, code keeping its file
                "nn_handler.utils._workers.pipes",  # its end of the pipe: framed messages
                "nn_handler.utils._workers.task_errors",  # what a task's exception becomes
                "nn_handler.utils._workers.function_memo",  # its copies of functions that cannot change
                "nn_handler.utils._workers.server"}  # its Process class (a start that leaves __main__ alone)


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
        or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_time_nodes(tree: ast.Module, type_checking: bool, in_functions: bool = False):
    """Import statements that run when the module is imported (not those inside functions, unless ``in_functions``)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif _is_type_checking(node) and not type_checking:
            stack.extend(node.orelse)
        elif in_functions or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def import_graph(type_checking: bool = True, in_functions: bool = False) -> dict[str, set[str]]:
    """``{module: the nn_handler modules it imports}`` for every module of the package.

    ``type_checking=False``: only what runs, without the ``if TYPE_CHECKING:`` imports.
    ``in_functions=True``: the imports inside functions too (what the module may load later).
    """
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        edges = graph.setdefault(name, set())
        for node in _import_time_nodes(ast.parse(path.read_text(), str(path)), type_checking, in_functions):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = name.split(".")
                    base = base[: len(base) - node.level + (1 if is_package else 0)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                # `from . import _transport` imports a module; `from .errors import X` a name of one.
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in files else module for a in node.names]
            edges.update(t for t in targets if t in files and t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path) per strongly connected component with more than one module (Tarjan)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _closure(graph: dict[str, set[str]], start: str) -> set[str]:
    """What importing ``start`` loads: its imports, theirs, and the packages above each of them."""
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # importing a.b runs a/__init__ first
        todo.extend(graph.get(module, ()))
    return seen


# ----------------------------------------------------------------------------- import graph (ast, no running)
def test_the_import_graph_reads_relative_and_type_checking_imports():
    graph = import_graph()
    assert "nn_handler.errors" in graph["nn_handler.utils._workers.task_errors"]  # `from ...errors import`
    assert "nn_handler.utils._workers.transport" in graph["nn_handler.utils._workers.worker"]  # `from . import _transport`
    assert "nn_handler.utils.ddp" in graph["nn_handler.utils._collectives"]
    assert "nn_handler.history" in graph["nn_handler._callback"]  # under TYPE_CHECKING
    assert "nn_handler.history" not in import_graph(type_checking=False)["nn_handler.callbacks"]


def test_the_import_graph_has_no_cycle():
    cycles = _cycles(import_graph(in_functions=True))  # a circle closed inside a function is one too
    assert not cycles, "modules that import each other (directly or around a circle): " + "; ".join(
        " <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("module", ["nn_handler.callbacks", "nn_handler.loggers"])
def test_callbacks_and_loggers_never_import_the_trainer(module):
    assert "nn_handler.handler" not in import_graph()[module]  # not even under TYPE_CHECKING
    assert "nn_handler.handler" not in _closure(import_graph(type_checking=False), module)
    assert "nn_handler.handler" not in import_graph(in_functions=True)[module]  # nor lazily


def test_errors_import_nothing_from_the_package():
    # but their failure record, which imports nothing either
    assert import_graph()["nn_handler.errors"] == {"nn_handler._failure_record"}
    assert import_graph()["nn_handler._failure_record"] == set()


# A module longer than this holds more than one idea; handler.py is the public face, mostly docstrings.
MAX_LINES = 600
MAX_LINES_OF = {"nn_handler/handler.py": 700}


def test_no_module_is_longer_than_its_budget():
    too_long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(REPO).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES_OF.get(where, MAX_LINES):
            too_long[where] = lines
    assert not too_long, f"modules over their line budget ({MAX_LINES}; {MAX_LINES_OF}): {too_long}"


def test_the_training_package_never_imports_the_trainer_or_concrete_callbacks():
    # _training takes explicit parts: the public face imports it, never the other way round (not even
    # deferred, inside a function), and callbacks reach it only as the TrainerView protocol.
    files = sorted((PACKAGE / "_training").rglob("*.py"))
    assert len(files) > 5
    for path in files:
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                targets = [(module, alias.name) for alias in node.names]
            else:
                continue
            for module, imported in targets:
                assert module != "nn_handler.handler" and (module, imported) != ("nn_handler", "handler"), \
                    f"{name} imports the trainer (line {node.lineno})"
                assert module != "nn_handler", f"{name} imports the package face, which loads the trainer"
                if module == "nn_handler.callbacks":
                    assert imported == "TrainerView", f"{name} imports callbacks.{imported} (line {node.lineno})"


@pytest.mark.parametrize("start", ["nn_handler", "nn_handler.utils._workers.worker"])
def test_the_package_face_and_the_worker_child_import_no_trainer_or_model_helpers(start):
    loaded = _closure(import_graph(type_checking=False), start)
    assert not loaded & NOT_IN_A_WORKER, f"importing {start} loads {sorted(loaded & NOT_IN_A_WORKER)}"


def test_the_worker_pool_never_imports_the_trainer_callbacks_or_model_helpers():
    graph = import_graph(in_functions=True)  # a lazy import inside a function counts too
    direct = {module: sorted(t for t in targets if _within(t, NOT_FOR_WORKERS))
              for module, targets in graph.items() if _within(module, [WORKERS])}
    direct = {module: targets for module, targets in direct.items() if targets}
    assert not direct, f"the worker pool imports what it must not (imports point one way): {direct}"
    runs = import_graph(type_checking=False)
    for module in (m for m in runs if _within(m, [WORKERS])):  # nor through the modules it imports
        loaded = {m for m in _closure(runs, module) if _within(m, NOT_FOR_WORKERS)}
        assert not loaded, f"importing {module} loads {sorted(loaded)}"


def test_the_worker_child_imports_only_the_worker_its_transport_and_the_errors():
    loaded = _closure(import_graph(type_checking=False), "nn_handler.utils._workers.worker")
    assert loaded <= WORKER_CHILD, f"a worker child also loads {sorted(loaded - WORKER_CHILD)}"


def test_only_the_worker_pool_starts_processes():
    """One engine: the launcher, the test helper and the CLI start their ranks through utils/_workers.

    The one other process: a tracker's client (``_tracking/child.py``), no rank and no worker, a plain
    interpreter that sends a logger's records.
    """
    starts = []
    for path in PACKAGE.rglob("*.py"):
        if _within(_module_name(path), [WORKERS]) or _module_name(path) == "nn_handler._tracking.child":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            func = getattr(node, "func", None) if isinstance(node, ast.Call) else None
            name = getattr(func, "attr", None) or getattr(func, "id", None)
            if name in {"Process", "Pipe", "Popen", "spawn", "start_processes"}:
                starts.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {name}()")
    assert not starts, f"processes started outside nn_handler/utils/_workers: {starts}"


# ----------------------------------------------------------------------------- a real worker child
_LOADED_BY_A_WORKER = """
import json, sys

def loaded_modules():  # defined here so that it travels by value and imports nothing of ours
    return sorted(m for m in sys.modules if m == "nn_handler" or m.startswith("nn_handler."))

if __name__ == "__main__":  # the worker imports this script: only the executor's own imports count
    from nn_handler import ParallelExecutor

    with ParallelExecutor(device_ids=["cpu"], pass_device=False, timeout=90) as ex:
        [loaded] = ex.run(loaded_modules)
    print("LOADED", json.dumps(loaded))
"""


@pytest.mark.timeout(120)
def test_a_worker_child_loads_no_trainer_callbacks_or_model_helpers(tmp_path):
    # What a worker imports itself, from the forkserver (a fresh interpreter that imported torch and the worker
    # module): in a fresh process.
    script = tmp_path / "loaded.py"
    script.write_text(_LOADED_BY_A_WORKER)
    out = run_command([sys.executable, str(script)], timeout=110,
                      env={"PYTHONPATH": str(REPO)}).stdout
    [line] = [line for line in out.splitlines() if line.startswith("LOADED ")]
    loaded = json.loads(line[len("LOADED "):])
    assert "nn_handler.utils._workers.worker" in loaded  # it really ran in a worker
    assert not set(loaded) & NOT_IN_A_WORKER, f"a worker child loaded {loaded}"
    assert set(loaded) <= WORKER_CHILD, f"a worker child also loaded {sorted(set(loaded) - WORKER_CHILD)}"


_IMPORTS_THE_TRAINER = """
import json, sys
import torch
from nn_handler import NNHandler, StepContext
from nn_handler.callbacks import EMA, ModelCheckpoint
heavy = ("torch.distributed.fsdp", "torch.distributed.checkpoint", "torch.distributed.tensor")
print("LOADED", json.dumps(sorted(m for m in sys.modules if m.startswith(heavy))))
"""


@pytest.mark.timeout(120)
def test_importing_the_trainer_loads_neither_fsdp_nor_dcp(tmp_path):
    # They bring DTensor with them: half a second at import (import nn_handler.handler took 0.6 s, now 0.1 s).
    # Sharding and sharded checkpoints import them where they are used. (torch.optim imports torch._dynamo, and
    # with it FSDP, when the first optimizer is made: a training script pays it there, as without nn_handler.)
    script = tmp_path / "imports.py"
    script.write_text(_IMPORTS_THE_TRAINER)
    out = run_command([sys.executable, str(script)], timeout=110, env={"PYTHONPATH": str(REPO)}).stdout
    [line] = [line for line in out.splitlines() if line.startswith("LOADED ")]
    assert json.loads(line[len("LOADED "):]) == []


# ----------------------------------------------------------------------------- the public names stay
# Each public module's __all__ as of issue 15 (plus the seed's aliases), written out so that none can vanish.
PUBLIC_NAMES = {
    "nn_handler": [
        "__version__", "NNHandlerError", "LaunchEnvironmentError", "DeviceError", "ParallelExecutionError",
        "WorkerDiedError", "RankFailedError", "ParallelExecutor", "parallelize_on_gpus", "ExecutorTimeoutError",
        "worker_state", "initialize_ddp", "resolve_device", "should_use_distributed", "get_rank", "get_local_rank",
        "get_world_size", "is_distributed", "is_main_process", "barrier", "cleanup_ddp", "find_free_port",
        "on_rank", "main_process_first", "any_rank", "all_ranks", "parallel_on_all_devices", "ConfigurationError",
        "MultiGPUConfig", "MultiGPUMode", "resolve_parallel_mode", "prepare_model", "prepare_dataloader",
        "unwrap_parallel_model", "setup_parallel_model", "parallelize_if_available", "get_device_count",
        "is_parallel_available", "get_gpu_memory_info", "print_gpu_memory_info", "get_gpu_stats",
        "get_recommended_batch_size", "dispatch_model", "plan_device_map", "parallel_predict",
        "get_data_parallel_info", "validate_data_parallel_setup", "NNHandler", "StepContext", "History", "Callback",
        "EarlyStopping", "ModelCheckpoint", "CSVLogger", "TensorBoardLogger", "MLflowLogger", "WandbLogger",
        "NonFiniteLossError", "CheckpointError",
        "CheckpointMismatchError", "MissingExtraError", "TrainingPreempted", "PREEMPTED_EXIT_CODE",
        "seed_everything",
    ],
    "nn_handler.seeding": ["seed_everything"],
    "nn_handler.utils.ddp": [
        "initialize_ddp", "resolve_device", "should_use_distributed", "get_rank", "get_local_rank",
        "get_world_size", "is_distributed", "is_main_process", "barrier", "cleanup_ddp", "find_free_port",
        "detect_launch_env", "LaunchEnv", "_should_use_distributed", "_resolve_device",
    ],
    "nn_handler.utils.ddp_decorators": [
        "on_rank", "main_process_first", "any_rank", "all_ranks", "parallel_on_all_devices", "ParallelExecutor",
        "parallelize_on_gpus", "ExecutorTimeoutError", "worker_state",
    ],
    "nn_handler.utils.parallel": [
        "MultiGPUMode", "MultiGPUConfig", "resolve_parallel_mode", "prepare_model", "prepare_dataloader",
        "unwrap_parallel_model", "get_device_count", "is_parallel_available", "get_gpu_memory_info",
        "print_gpu_memory_info", "get_gpu_stats", "get_recommended_batch_size", "setup_parallel_model",
        "parallelize_if_available", "dispatch_model", "plan_device_map", "parse_memory_size", "DEVICE_MAP_ATTR",
        "parallel_predict", "get_data_parallel_info", "validate_data_parallel_setup",
    ],
    "nn_handler.errors": [
        "NNHandlerError", "LaunchEnvironmentError", "DeviceError", "ConfigurationError", "RankFailure",
        "ParallelExecutionError", "WorkerDiedError", "RankFailedError", "NonFiniteLossError", "CheckpointError",
        "CheckpointMismatchError", "MissingExtraError",
    ],
    "nn_handler.callbacks": ["Callback", "EarlyStopping", "ModelCheckpoint", "CSVLogger"],
    "nn_handler.loggers": ["TensorBoardLogger", "MLflowLogger", "WandbLogger"],
    "nn_handler.checkpoint": [
        "FORMAT", "atomic_save", "load_payload", "load_weights", "state_dict_diff", "capture_rng_state",
        "restore_rng_state", "list_checkpoints", "is_temp_file", "run_checkpoint_name", "run_checkpoint_key",
        "UNNAMED_RUN", "run_info", "read_run_info", "RunCheckpoint", "scan_run_checkpoints", "list_run_checkpoints",
        "prune_run_checkpoints", "remove_stale_temp_files",
    ],
    "nn_handler.testing": ["run_distributed", "DistributedTimeoutError", "RemoteFailure"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC_NAMES))
def test_every_public_module_keeps_every_name(module):
    mod = importlib.import_module(module)
    missing = [name for name in PUBLIC_NAMES[module] if not hasattr(mod, name)]
    assert not missing, f"{module} lost {missing}"
    if hasattr(mod, "__all__"):
        assert set(PUBLIC_NAMES[module]) - set(mod.__all__) <= {"_should_use_distributed", "_resolve_device"}


def test_package_names_are_the_objects_of_their_home_modules():
    import nn_handler
    from nn_handler import callbacks, errors, handler, history
    from nn_handler.utils import ddp, ddp_decorators, parallel

    assert nn_handler.NNHandler is handler.NNHandler and nn_handler.History is history.History
    assert nn_handler.EarlyStopping is callbacks.EarlyStopping and nn_handler.RankFailedError is errors.RankFailedError
    assert nn_handler.on_rank is ddp_decorators.on_rank
    assert nn_handler.parallelize_on_gpus is ddp_decorators.parallelize_on_gpus
    assert nn_handler.initialize_ddp is ddp.initialize_ddp and nn_handler.prepare_model is parallel.prepare_model
    assert set(nn_handler.__all__) <= set(dir(nn_handler))
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        nn_handler.not_a_name  # noqa: B018


def test_every_public_exception_lives_in_errors():
    from nn_handler import errors

    public = {}
    for module in PUBLIC_NAMES:
        mod = importlib.import_module(module)
        for name in getattr(mod, "__all__", ()):
            obj = getattr(mod, name)
            if isinstance(obj, type) and issubclass(obj, BaseException):
                public[f"{module}.{name}"] = obj
    for module in ("nn_handler.utils._workers.pool", "nn_handler._training.preemption"):  # private homes of public errors
        mod = importlib.import_module(module)
        for name, obj in vars(mod).items():
            if isinstance(obj, type) and issubclass(obj, BaseException) and not name.startswith("_"):
                public[f"{module}.{name}"] = obj
    elsewhere = sorted(where for where, cls in public.items() if cls.__module__ != "nn_handler.errors")
    assert not elsewhere, f"public exceptions defined outside nn_handler.errors: {elsewhere}"
    assert all(getattr(errors, cls.__name__) is cls for cls in public.values())

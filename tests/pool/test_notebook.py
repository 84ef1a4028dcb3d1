"""examples/notebook.ipynb runs top to bottom in a real Jupyter kernel, where spawn and pickling usually break."""

from __future__ import annotations

import re

import pytest

from helpers import REPO

nbformat = pytest.importorskip("nbformat", reason="needs the test extra: pip install -e '.[test]'")
nbclient = pytest.importorskip("nbclient", reason="needs the test extra: pip install -e '.[test]'")
pytest.importorskip("ipykernel", reason="needs the test extra: pip install -e '.[test]'")

NOTEBOOK = REPO / "examples" / "notebook.ipynb"
CELL_TIMEOUT = 240  # per cell; below the test's own backstop


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook after one execution in a fresh python3 kernel (cwd: a temp dir)."""
    workdir = tmp_path_factory.mktemp("notebook")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell fails
    return nb, workdir


def _cell(nb, tag):
    (cell,) = [c for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]
    return cell


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.timeout(600)
def test_notebook_runs_in_a_kernel_and_shows_what_it_says(executed):
    nb, workdir = executed

    decorator = _text(_cell(nb, "decorator"))
    sums = re.findall(r"^(\S+) \[180\.0, 190\.0, 200\.0, 210\.0\]$", decorator, re.M)
    assert len(sums) >= 1, decorator
    assert f"{len(sums)} workers, distinct processes: True, same workers on the second call: True" in decorator

    assert re.search(r"\d+ batches on .+; same as the model run here: True", _text(_cell(nb, "initializer")))

    launch = _text(_cell(nb, "launch"))
    assert re.search(r"trained on \d+ processes \(DistributedDataParallel\)", launch), launch
    val = [float(v) for v in re.findall(r"^epoch \d: train_loss [\d.]+  val_loss ([\d.]+)$", launch, re.M)]
    assert len(val) == 5 and val[-1] < val[0], launch

    plot = _cell(nb, "plot")
    assert any("image/png" in o.get("data", {}) for o in plot.outputs)
    assert (workdir / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"

    errors = _text(_cell(nb, "errors")).splitlines()
    assert re.fullmatch(r"check_batch failed on rank \d \(\S+, pid \d+\): ValueError: batch contains NaN", errors[0])
    assert errors[1] == ("positional argument 0 of check_batch (lock) cannot be pickled to send to the workers: "
                         "cannot pickle '_thread.lock' object")
    assert errors[2].startswith("still usable: [3.0")

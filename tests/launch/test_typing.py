"""What type checkers see of the installed package: the wheel carries ``py.typed``, and mypy checks a user's script.

The package is built into a wheel and installed into a directory of its own
(not the source tree on the path), as a user gets it; mypy then checks
``tests/scripts/typed_user.py`` against that copy from another directory.
mypy's analysis of torch is cached between runs (the first run takes a while).
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from helpers import REPO, needs, run_command

pytestmark = needs("mypy")

SCRIPT = REPO / "tests" / "scripts" / "typed_user.py"
MYPY_CACHE = Path(tempfile.gettempdir()) / "nn_handler-mypy-cache"
_ERROR = re.compile(r"^(?P<file>[^:\n]+):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$", re.M)
_EXPECTED = re.compile(r"# error: \[(?P<codes>[a-z-, ]+)\]")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Built from a copy: pip builds in place and would leave build/ and *.egg-info in the repository.
    src = tmp_path_factory.mktemp("src")
    shutil.copytree(REPO / "nn_handler", src / "nn_handler", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    built = run_command([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                         "-w", str(out), str(src)], timeout=300, cwd=out)
    assert built.returncode == 0, built.stdout
    [path] = out.glob("nn_handler-*.whl")
    return path


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    done = run_command([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                        str(target), str(wheel)], timeout=300, cwd=target)
    assert done.returncode == 0, done.stdout
    return target


def mypy(script: Path, site: Path) -> tuple[set[tuple[int, str]], str]:
    """``{(line, error code)}`` that mypy reports for ``script`` with ``site`` as the only path to nn_handler."""
    workdir = Path(tempfile.mkdtemp(prefix="typed-user-"))
    try:
        shutil.copy(script, workdir / script.name)  # checked from elsewhere: no source tree next to it
        # The trackers' packages (imported inside nn_handler's loggers) are not what this checks: analysing
        # mlflow and wandb and what they pull in would be most of the run.
        (workdir / "mypy.ini").write_text("[mypy]\n[mypy-mlflow.*,wandb.*,mlflow,wandb]\nfollow_imports = skip\n")
        done = run_command([sys.executable, "-m", "mypy", "--follow-imports=silent", "--show-error-codes",
                            "--no-error-summary", "--cache-dir", str(MYPY_CACHE), "--python-executable",
                            sys.executable, script.name],
                           timeout=400, cwd=workdir, env={"PYTHONPATH": str(site)})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert done.returncode in (0, 1), done.stdout  # 2: mypy itself failed
    return {(int(m["line"]), m["code"]) for m in _ERROR.finditer(done.stdout)}, done.stdout


def expected_errors(script: Path) -> set[tuple[int, str]]:
    expected = set()
    for number, line in enumerate(script.read_text().splitlines(), start=1):
        for m in _EXPECTED.finditer(line):
            expected.update((number, code.strip()) for code in m["codes"].split(","))
    return expected


def test_the_wheel_carries_py_typed(wheel):
    assert "nn_handler/py.typed" in zipfile.ZipFile(wheel).namelist()


@pytest.mark.timeout(600)
def test_mypy_reports_exactly_the_wrong_calls_of_a_user_script_against_the_installed_package(installed):
    assert (installed / "nn_handler" / "py.typed").exists() and not (installed / "nn_handler" / "setup.cfg").exists()
    expected = expected_errors(SCRIPT)
    assert len(expected) >= 10
    found, output = mypy(SCRIPT, installed)
    assert found == expected, output


@pytest.mark.timeout(600)
def test_without_py_typed_mypy_treats_the_package_as_untyped(installed, tmp_path):
    untyped = tmp_path / "site"
    shutil.copytree(installed / "nn_handler", untyped / "nn_handler")
    (untyped / "nn_handler" / "py.typed").unlink()
    found, output = mypy(SCRIPT, untyped)
    assert ("import-untyped" in {code for _, code in found}), output

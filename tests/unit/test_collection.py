"""Every test file in the repository is collected by the README's test command.

pytest's default ``norecursedirs`` skips folders named ``dist``, ``build`` and
a few others without a word: a test folder with such a name never runs in CI.
This asks pytest itself which files the plain ``python -m pytest`` collects
and compares them with the ``test_*.py`` files on disk.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO

# Helper scripts that tests launch; pytest is told to ignore them (setup.cfg addopts).
NOT_TESTS = {"scripts"}


@pytest.mark.slow
def test_the_readme_test_command_collects_every_test_file():
    on_disk = {p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py")
               if not NOT_TESTS & set(p.relative_to(REPO / "tests").parts)}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    collected = {line.split("::", 1)[0] for line in out.stdout.splitlines() if "::" in line}
    assert on_disk, "found no test files on disk"
    missing = sorted(on_disk - collected)
    assert not missing, (f"not collected by 'python -m pytest' (so CI never runs them): {missing}; "
                         f"is a folder named after one of pytest's norecursedirs (dist, build, ...)?\n"
                         f"{out.stdout[-2000:]}{out.stderr[-2000:]}")

"""Every test file in the repository is collected by the README's test command.

pytest's default ``norecursedirs`` skips folders named ``dist``, ``build`` and
a few others without a word: a test folder with such a name never runs in CI.
This asks pytest itself which files the plain ``python -m pytest`` collects
and compares them with the ``test_*.py`` files on disk. Where this session is
that command (its test paths, every test selected), its own collection is the
answer; otherwise a ``pytest --collect-only`` of the plain command gives it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

# Helper scripts that tests launch; pytest is told to ignore them (setup.cfg addopts).
NOT_TESTS = {"scripts"}


def _is_the_plain_command(config) -> bool:
    """This session collected what ``python -m pytest`` collects: its test paths, nothing left out or deselected."""
    ini_ignores = [arg.split("=", 1)[1] for arg in config.getini("addopts") if arg.startswith("--ignore=")]
    return (config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.markexpr
            and not config.option.keyword and not config.option.deselect and not config.option.ignore_glob
            and list(config.option.ignore or []) == ini_ignores)


def _collected_by_the_plain_command(request) -> tuple[set[str], str]:
    if _is_the_plain_command(request.config):  # (under pytest-xdist every worker collects every test too)
        return {Path(item.path).relative_to(REPO).as_posix() for item in request.session.items}, ""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    collected = {line.split("::", 1)[0] for line in out.stdout.splitlines() if "::" in line}
    return collected, f"{out.stdout[-2000:]}{out.stderr[-2000:]}"


@pytest.mark.slow
def test_the_readme_test_command_collects_every_test_file(request):
    on_disk = {p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py")
               if not NOT_TESTS & set(p.relative_to(REPO / "tests").parts)}
    collected, output = _collected_by_the_plain_command(request)
    assert on_disk, "found no test files on disk"
    missing = sorted(on_disk - collected)
    assert not missing, (f"not collected by 'python -m pytest' (so CI never runs them): {missing}; "
                         f"is a folder named after one of pytest's norecursedirs (dist, build, ...)?\n{output}")

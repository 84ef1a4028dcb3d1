"""Every ```python block in README.md and docs/*.md runs, unless it is marked as not runnable here, with a reason.

Conventions, for writers of the docs:

- A ```python block runs as a script of its own (``__name__ == "__main__"``),
  in a fresh working directory, so it must be self-contained. A block that
  starts processes needs its ``if __name__ == "__main__":`` guard, as it would
  in a file: worker processes import the script.
- A block whose first line starts with ``>>>`` runs as a doctest instead, with
  the names of ``nn_handler.__all__`` already imported.
- ``<!-- not-run: REASON -->`` on the line before a block skips it (e.g. GPU
  only, or a fragment that needs the reader's own model); the reason is required.
- ``<!-- output -->`` on the line before a ```text block makes it the expected
  output of the nearest ```python block above it: every non-blank line must
  appear in the block's output, in order, with ``...`` matching anything.

All blocks of one file run in one subprocess (each block as its own
``__main__`` module; launch variables, the process group and warm worker pools
are reset between blocks) to pay Python's and torch's start-up once per file.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import REPO, run_command

DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK_TIMEOUT = 120  # per block (SIGALRM in the runner) < FILE_TIMEOUT (whole subprocess) < the pytest backstop
FILE_TIMEOUT = 420
MARKER = "@@nn_handler-doc-block"

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,})(?P<info>[^`]*)$")
_NOT_RUN = re.compile(r"^\s*<!--\s*not-run:(?P<reason>.*?)-->\s*$")
_OUTPUT = re.compile(r"^\s*<!--\s*output\s*-->\s*$")


@dataclass
class Block:
    """One fenced code block of a Markdown file."""

    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    not_run: str | None = None  # the reason, when marked not-run
    expect_output: bool = False  # a ```text block marked as the output of the python block above
    expected: list[str] = field(default_factory=list)  # for python blocks: the lines their output must contain

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def is_doctest(self) -> bool:
        return self.code.lstrip().startswith(">>>")


def extract_blocks(path: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of a Markdown file, with their markers resolved.

    Raises:
        ValueError: A fence is not closed, a not-run marker has no reason, or
            an output marker does not sit on a ```text block after a run python block.
    """
    lines = (path.read_text() if text is None else text).splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m["indent"]), m["fence"], m["info"].strip().split(" ")[0].lower()
        start = i
        body = []
        i += 1
        # A closing fence: backticks only, at least as many as the opening one.
        while i < len(lines) and not (lines[i].strip().startswith(fence) and set(lines[i].strip()) == {"`"}):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{path}:{start + 1}: code fence is not closed")
        i += 1
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        block = Block(path, start + 1, lang, "\n".join(body) + "\n")
        marker = _NOT_RUN.match(before)
        if marker:
            block.not_run = marker["reason"].strip()
            if not block.not_run:
                raise ValueError(f"{block.where}: a not-run marker needs a reason: <!-- not-run: GPU only: ... -->")
        if _OUTPUT.match(before):
            owner = next((b for b in reversed(blocks) if b.lang in ("python", "py")), None)
            if lang != "text" or owner is None or owner.not_run is not None or owner.is_doctest:
                raise ValueError(f"{block.where}: <!-- output --> must mark a ```text block that follows a python "
                                 f"block which runs as a script")
            block.expect_output = True
            owner.expected.extend(line for line in block.code.splitlines() if line.strip())
        blocks.append(block)
    return blocks


def python_blocks(path: Path, text: str | None = None) -> list[Block]:
    return [b for b in extract_blocks(path, text) if b.lang in ("python", "py")]


# The child: runs each block as __main__ in a fresh directory and brackets its output with markers.
RUNNER = r'''
import doctest, json, os, runpy, signal, sys, tempfile, traceback

blocks = json.load(open(sys.argv[1]))
timeout = int(sys.argv[2])
home = os.getcwd()
clean_env = dict(os.environ)


class BlockTimeout(Exception):
    pass


def on_alarm(signum, frame):
    raise BlockTimeout(f"the block ran for more than {timeout} s")


def reset():
    # What a fresh interpreter would give the next block.
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        traceback.print_exc()
    if "nn_handler.utils._workers.reusable" in sys.modules:
        sys.modules["nn_handler.utils._workers.reusable"]._warm_pools.shutdown_all()
    os.environ.clear()
    os.environ.update(clean_env)
    os.chdir(home)


signal.signal(signal.SIGALRM, on_alarm)
for i, block in enumerate(blocks):
    print(f"\n{MARKER} {i} start@@", flush=True)
    ok = True
    workdir = tempfile.mkdtemp(prefix=f"docblock{i}-", dir=home)  # under the test's tmp_path: pytest removes it
    os.chdir(workdir)
    signal.alarm(timeout)
    try:
        if block["doctest"]:
            import nn_handler
            names = {name: getattr(nn_handler, name) for name in nn_handler.__all__}
            test = doctest.DocTestParser().get_doctest(block["code"], names, block["where"], block["where"], 0)
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
            ok = runner.run(test).failed == 0
        else:
            runpy.run_path(block["file"], run_name="__main__")
    except SystemExit as exc:
        ok = exc.code in (None, 0)
        if not ok:
            print(f"SystemExit({exc.code!r})")
    except BaseException:
        ok = False
        traceback.print_exc(file=sys.stdout)
    finally:
        signal.alarm(0)
    sys.stdout.flush()
    sys.stderr.flush()
    reset()
    print(f"\n{MARKER} {i} {'ok' if ok else 'FAILED'}@@", flush=True)
'''.replace("{MARKER}", MARKER)


def run_blocks(blocks: list[Block], tmp_path: Path) -> list[tuple[bool | None, str]]:
    """Run the blocks in one subprocess; ``(passed, output)`` per block (``None``: the runner never finished it)."""
    specs = []
    for i, block in enumerate(blocks):
        script = tmp_path / f"block{i}_{block.path.stem}_{block.line}.py"
        script.write_text(block.code)
        specs.append({"file": str(script), "code": block.code, "doctest": block.is_doctest, "where": block.where})
    (tmp_path / "blocks.json").write_text(json.dumps(specs))
    (tmp_path / "runner.py").write_text(RUNNER)
    result = run_command([sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "blocks.json"),
                          str(BLOCK_TIMEOUT)], timeout=FILE_TIMEOUT, cwd=tmp_path)
    outcomes: list[tuple[bool | None, str]] = []
    for i in range(len(blocks)):
        match = re.search(rf"{MARKER} {i} start@@\n(.*?)\n{MARKER} {i} (ok|FAILED)@@", result.stdout, re.S)
        if match:
            outcomes.append((match[2] == "ok", match[1]))
        else:
            tail = result.stdout.split(f"{MARKER} {i} start@@", 1)[-1]
            outcomes.append((None, f"(the runner exited with {result.returncode} before finishing the block)\n{tail}"))
    return outcomes


def output_mismatch(expected: list[str], output: str) -> str | None:
    """``None`` when every expected line matches an output line, in order (``...`` matches anything)."""
    lines = output.splitlines()
    pos = 0
    for want in expected:
        pattern = re.compile(".*?".join(re.escape(part) for part in want.strip().split("...")))
        while pos < len(lines) and not pattern.search(lines[pos]):
            pos += 1
        if pos == len(lines):
            return want
        pos += 1
    return None


# ----------------------------------------------------------------------------- the docs
@pytest.mark.timeout(FILE_TIMEOUT + 60)
@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_python_blocks_run(path, tmp_path):
    blocks = [b for b in python_blocks(path) if b.not_run is None]
    if not blocks:
        pytest.skip(f"{path.relative_to(REPO)} has no runnable python block")
    failures = []
    for block, (passed, output) in zip(blocks, run_blocks(blocks, tmp_path)):
        if not passed:
            failures.append(f"--- {block.where} failed:\n{output[-3000:]}")
        elif block.expected and (missing := output_mismatch(block.expected, output)) is not None:
            failures.append(f"--- {block.where}: the documented output line\n    {missing}\n"
                            f"was not found (in order) in what the block printed:\n{output[-3000:]}")
    if failures:
        pytest.fail(f"{len(failures)} of {len(blocks)} blocks in {path.name} failed:\n" + "\n".join(failures),
                    pytrace=False)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file (code blocks excluded)."""
    text = re.sub(r"^ *```.*?^ *```", "", path.read_text(), flags=re.S | re.M)
    slugs = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        slugs.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return slugs


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_markers_and_links_are_well_formed(path):
    blocks = extract_blocks(path)  # raises on a marker without a reason or a misplaced output marker
    text = path.read_text()
    lines = text.splitlines()
    assert sum(bool(_NOT_RUN.match(line)) for line in lines) == sum(b.not_run is not None for b in blocks), \
        f"{path.name}: a not-run marker is not directly above a code block"
    assert sum(bool(_OUTPUT.match(line)) for line in lines) == sum(b.expect_output for b in blocks), \
        f"{path.name}: an output marker is not directly above a ```text block"
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # code is not Markdown: skip fenced blocks
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", prose):
        if "://" in target or target.startswith("mailto:"):
            continue
        linked = (path.parent / target) if target else path
        assert linked.exists(), f"{path.name} links to {target}, which does not exist"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked), f"{path.name} links to {target}#{anchor}: no such heading"


def test_readme_commands_match_ci():
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"^python3 -m venv .*$", readme, re.M)
    assert len(commands) == 2, "README.md must keep its two commands"
    main_command, test_command = commands
    assert main_command.endswith(".venv/bin/python examples/quickstart.py")  # the flagship example
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert test_command in ci, ".ci/run must run exactly the README's test command"
    assert [line for line in ci if line.strip()][-1] == test_command, ".ci/run must end with the README's test command"
    quick = re.findall(r"^\.venv/bin/python -m pytest .*$", readme, re.M)
    assert len(quick) == 1, "README.md must give one quick subset command"
    assert quick[0] in ci[:ci.index(test_command)], ".ci/run must run the README's quick subset before the full command"
    assert ".ci/newcomer" in ci, ".ci/run must run the newcomer's path"
    newcomer = (REPO / ".ci" / "newcomer").read_text().splitlines()
    assert main_command in newcomer, ".ci/newcomer must run exactly the README's main command"


def test_quickstart_installs_as_the_readme_does():
    readme = (REPO / "README.md").read_text()
    main_command = re.findall(r"^python3 -m venv .*$", readme, re.M)[0]
    install = main_command.removesuffix(" && .venv/bin/python examples/quickstart.py")
    assert install in (REPO / "docs" / "quickstart.md").read_text().splitlines(), install


def test_readme_taste_as_a_script_prints_each_line_once(tmp_path):
    # Copied into a file and run with python: the ranks of run_distributed are
    # spawned processes, which must not re-run the script's top-level prints.
    readme = REPO / "README.md"
    start = readme.read_text().splitlines().index("## A taste") + 1
    taste = next(b for b in extract_blocks(readme) if b.lang == "python" and b.line > start)
    script = tmp_path / "taste.py"
    script.write_text(taste.code)
    result = run_command([sys.executable, str(script)], timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stdout
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines.count("False 0 1 cpu") == 1 and lines.count("[(3, 2, 'cpu'), (3, 2, 'cpu')]") == 1, result.stdout
    assert len(lines) == len(set(lines)), result.stdout  # the device line and its warning once too


def test_docs_index_lists_every_page():
    index = (REPO / "docs" / "README.md").read_text()
    for page in sorted((REPO / "docs").glob("*.md")):
        if page.name != "README.md":
            assert f"]({page.name})" in index, f"docs/README.md does not link to {page.name}"


# ----------------------------------------------------------------------------- the machinery itself
SAMPLE = textwrap.dedent('''\
    # Sample

    ```python
    print("hello from", __name__)
    ```

    <!-- output -->
    ```text
    hello from __main__
    ```

    <!-- not-run: GPU only: needs two CUDA devices -->
    ```python
    raise SystemExit("must not run")
    ```

    ```python
    >>> 1 + 1
    2
    ```

    - a list item with an indented block:

      ```python
      import sys
      sys.exit(3)
      ```
    ''')


def test_extract_blocks_resolves_markers():
    blocks = extract_blocks(REPO / "docs" / "sample.md", SAMPLE)
    assert [(b.lang, b.line) for b in blocks] == [("python", 3), ("text", 8), ("python", 13), ("python", 17),
                                                   ("python", 24)]
    assert blocks[0].expected == ["hello from __main__"] and blocks[1].expect_output
    assert blocks[2].not_run == "GPU only: needs two CUDA devices"
    assert blocks[3].is_doctest and not blocks[0].is_doctest
    assert blocks[4].code == "import sys\nsys.exit(3)\n"


@pytest.mark.parametrize("text, message", [
    ("<!-- not-run: -->\n```python\npass\n```\n", "needs a reason"),
    ("<!-- output -->\n```text\nx\n```\n", "must mark a ```text block"),
    ("```python\npass\n", "not closed"),
])
def test_extract_blocks_rejects_bad_markup(text, message):
    with pytest.raises(ValueError, match=message):
        extract_blocks(REPO / "docs" / "bad.md", text)


def test_a_failing_block_fails_and_the_others_still_run(tmp_path):
    runnable = [b for b in python_blocks(REPO / "docs" / "sample.md", SAMPLE) if b.not_run is None]
    outcomes = run_blocks(runnable, tmp_path)
    assert [passed for passed, _ in outcomes] == [True, True, False]
    assert output_mismatch(runnable[0].expected, outcomes[0][1]) is None
    assert "SystemExit(3)" in outcomes[2][1]

    bad = python_blocks(REPO / "docs" / "bad.md", "```python\n>>> 1 + 1\n3\n```\n```python\nimport nosuchmodule\n```\n")
    outcomes = run_blocks(bad, tmp_path)
    assert [passed for passed, _ in outcomes] == [False, False]
    assert "Expected:\n    3\nGot:\n    2" in outcomes[0][1]
    assert "ModuleNotFoundError: No module named 'nosuchmodule'" in outcomes[1][1]


def test_output_matching():
    output = "rank 1: RankFailedError: save failed on rank 0 (cpu, pid 4242): OSError: disk full\nmore\n"
    assert output_mismatch(["save failed on rank 0 (cpu, pid ...): OSError: disk full", "more"], output) is None
    assert output_mismatch(["more", "save failed"], output) == "save failed"  # order matters
    assert output_mismatch(["ValueError"], output) == "ValueError"

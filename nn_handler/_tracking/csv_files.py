"""The CSV files of :class:`~nn_handler.callbacks.CSVLogger`: the History's, and one row per logged step.

:func:`write_history` rewrites the History's file whole, atomically. In the
steps' file (:class:`StepCSV`), a row is appended at each logged step (the file is rewritten only when a
new column appears). A run that starts at global step ``s`` (a resumed or
continued run) keeps the rows up to ``s`` and drops the later ones, which a
run that crashed after its last checkpoint had written: the file then holds
every logged step once, as a run never stopped would.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "log_steps.csv")
    >>> f = StepCSV(path)
    >>> f.open(0)
    >>> f.write(2, {"train_loss": 0.5})
    >>> f.write(4, {"train_loss": 0.25, "train_d": 1.0})
    >>> f.close()
    >>> open(path).read().splitlines()
    ['step,train_loss,train_d', '2,0.5,', '4,0.25,1.0']
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Any, Iterable, TextIO


def write_history(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """``rows`` (the History's) as a CSV file, one column per key in the order they appear; atomically."""
    rows = list(rows)
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: ("" if v is None else v) for k, v in row.items()} for row in rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.write_text(buf.getvalue())
    os.replace(tmp, path)  # readers never see a half-written file


class StepCSV:
    """Appends logged steps to a CSV file; see the module's docstring."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.columns: list[str] = []
        self._file: TextIO | None = None

    def open(self, global_step: int) -> None:
        """Start writing at ``global_step``: rows of later steps in the file are dropped."""
        self.close()
        rows: list[dict[str, Any]] = []
        if self.path.exists():
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or [])
                rows = [row for row in reader if row.get("step", "").isdigit() and int(row["step"]) <= global_step]
        self._rewrite(rows)

    def write(self, step: int, values: dict[str, float]) -> None:
        row = {"step": step, **values}
        if any(key not in self.columns for key in row):
            self.close()
            with open(self.path, newline="") as f:
                rows = list(csv.DictReader(f))
            self.columns += [key for key in row if key not in self.columns]
            self._rewrite(rows)
        csv.DictWriter(self._file, fieldnames=self.columns, lineterminator="\n", restval="").writerow(row)
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        """The file anew with ``rows`` under the columns (atomically), then open to append."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp.{os.getpid()}")
        with open(tmp, "w", newline="") as f:
            if self.columns:
                writer = csv.DictWriter(f, fieldnames=self.columns, lineterminator="\n", restval="")
                writer.writeheader()
                writer.writerows(rows)
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", newline="")

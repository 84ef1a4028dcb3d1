"""A stand-in tracker client for the tests of ``nn_handler._tracking.child`` (imports neither torch nor a tracker)."""

from __future__ import annotations

import json
import time


class FileClient:
    """Appends each record it is sent to a JSON-lines file; its first use takes ``import_s`` seconds, as a
    tracker package's import does (``prepare`` or the first ``send``, whichever comes first)."""

    def __init__(self, path: str, import_s: float = 0.0, prepare_fails: bool = False):
        self.path, self.import_s, self.prepare_fails = path, import_s, prepare_fails
        self._imported = False

    def prepare(self) -> None:
        if self.prepare_fails:
            raise ImportError("no module named 'tracker' (a stand-in)")
        self._import()

    def _import(self) -> None:
        if not self._imported:
            time.sleep(self.import_s)  # stands for seconds of `import mlflow` under load
            self._imported = True

    def send(self, records: list) -> None:
        self._import()
        with open(self.path, "a") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        records.clear()

    def state(self) -> dict:
        return {}

"""The Recorder keeps every StepStats and RequestRecord and forwards them to sinks."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from workbench.metrics.stats import RequestRecord, StepStats


class JsonlSink:
    """Appends one JSON object per line: steps to ``steps.jsonl``, requests to ``requests.jsonl``.

    Args:
        folder: created if missing.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._steps = open(self.folder / "steps.jsonl", "a", encoding="utf-8")
        self._reqs = open(self.folder / "requests.jsonl", "a", encoding="utf-8")

    def on_step(self, s: StepStats) -> None:
        self._steps.write(json.dumps(s.to_dict()) + "\n")

    def on_request(self, r: RequestRecord) -> None:
        self._reqs.write(json.dumps(r.to_dict()) + "\n")

    def close(self) -> None:
        self._steps.close()
        self._reqs.close()


class CallbackSink:
    """Calls ``fn(step_stats)`` after every step (live plots use it)."""

    def __init__(self, fn: Callable[[StepStats], None], on_request: Callable[[RequestRecord], None] | None = None):
        self.fn = fn
        self.request_fn = on_request

    def on_step(self, s: StepStats) -> None:
        self.fn(s)

    def on_request(self, r: RequestRecord) -> None:
        if self.request_fn:
            self.request_fn(r)

    def close(self) -> None:
        pass


class Recorder:
    """In-memory table of steps and finished requests, plus sinks.

    Attributes:
        steps: every ``StepStats``, in order.
        requests: every finished request's ``RequestRecord``, in finishing order.
    """

    def __init__(self, sinks: list | None = None) -> None:
        self.steps: list[StepStats] = []
        self.requests: list[RequestRecord] = []
        self.sinks = list(sinks or [])

    def add_sink(self, sink) -> None:
        self.sinks.append(sink)

    def record_step(self, s: StepStats) -> None:
        self.steps.append(s)
        for sink in self.sinks:
            sink.on_step(s)

    def record_request(self, r: RequestRecord) -> None:
        self.requests.append(r)
        for sink in self.sinks:
            sink.on_request(r)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def to_pandas(self):
        """``(steps, requests)`` as two pandas DataFrames.

        Raises:
            ImportError: pandas is not installed.
        """
        import pandas as pd

        return (
            pd.DataFrame([s.to_dict() for s in self.steps]),
            pd.DataFrame([r.to_dict() for r in self.requests]),
        )

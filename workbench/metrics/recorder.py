"""The Recorder keeps every StepStats and RequestRecord and forwards them to sinks."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from pathlib import Path

from workbench.metrics.stats import RequestRecord, StepStats


class JsonlSink:
    """One JSON object per line: steps to ``steps.jsonl``, requests to ``requests.jsonl``,
    block maps to ``block_maps.jsonl``.

    Steps are written as they come (a live run can be followed with ``tail -f``); the split of
    unwritten slots into reservation and internal fragmentation is settled only when each
    request releases its blocks, so :meth:`close` rewrites ``steps.jsonl`` with the final figures.

    Args:
        folder: created if missing.
        live_steps: write each step as it comes (``False``: ``steps.jsonl`` is written once, at :meth:`close`; a
            simulated replay, which nobody follows live, saves writing its hundreds of thousands of steps twice).
    """

    def __init__(self, folder: str | Path, live_steps: bool = True) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._steps_path = self.folder / "steps.jsonl"
        self._steps = open(self._steps_path, "w", encoding="utf-8")
        self._reqs = open(self.folder / "requests.jsonl", "w", encoding="utf-8")
        self._maps = None
        self._all: list[StepStats] = []
        self.live_steps = live_steps

    def on_step(self, s: StepStats) -> None:
        self._all.append(s)
        if self.live_steps:
            self._steps.write(json.dumps(s.to_dict()) + "\n")

    def on_request(self, r: RequestRecord) -> None:
        self._reqs.write(json.dumps(r.to_dict()) + "\n")

    def on_block_map(self, snapshot: dict) -> None:
        if self._maps is None:
            self._maps = open(self.folder / "block_maps.jsonl", "w", encoding="utf-8")
        self._maps.write(json.dumps(snapshot) + "\n")

    def close(self) -> None:
        if self._steps.closed:
            return
        self._steps.close()
        self._reqs.close()
        if self._maps is not None:
            self._maps.close()
        with open(self._steps_path, "w", encoding="utf-8") as f:
            for s in self._all:
                f.write(json.dumps(s.to_dict()) + "\n")


class CallbackSink:
    """Calls ``fn(step_stats)`` after every step (live plots use it)."""

    def __init__(
        self,
        fn: Callable[[StepStats], None],
        on_request: Callable[[RequestRecord], None] | None = None,
        on_block_map: Callable[[dict], None] | None = None,
    ):
        self.fn = fn
        self.request_fn = on_request
        self.block_map_fn = on_block_map

    def on_block_map(self, snapshot: dict) -> None:
        if self.block_map_fn:
            self.block_map_fn(snapshot)

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
        block_maps: per-block pictures of the pool (``block_map_every``), see
            :meth:`workbench.kv.manager.KVCacheManager.block_map`.

    Args:
        sinks: where every record also goes as it comes.
        history: keep only the last ``history`` steps, requests and block maps (``deque`` s, for a
            long-running server whose memory must stay flat; sinks still see everything);
            ``None`` keeps all (lists).
    """

    def __init__(self, sinks: list | None = None, history: int | None = None) -> None:
        def table():
            return [] if history is None else deque(maxlen=history)

        self.steps: list[StepStats] = table()
        self.requests: list[RequestRecord] = table()
        self.block_maps: list[dict] = table()
        self.sinks = list(sinks or [])

    def add_sink(self, sink) -> None:
        self.sinks.append(sink)

    def remove_sink(self, sink) -> None:
        """Detach a sink (no-op when it is not attached)."""
        if sink in self.sinks:
            self.sinks.remove(sink)

    def record_step(self, s: StepStats) -> None:
        self.steps.append(s)
        for sink in self.sinks:
            sink.on_step(s)

    def record_block_map(self, snapshot: dict) -> None:
        self.block_maps.append(snapshot)
        for sink in self.sinks:
            fn = getattr(sink, "on_block_map", None)
            if fn is not None:
                fn(snapshot)

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

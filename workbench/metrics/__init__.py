"""Instrumentation: per-step StepStats, the Recorder and its sinks, per-request latency records."""

from workbench.metrics.recorder import CallbackSink, JsonlSink, Recorder
from workbench.metrics.stats import RequestRecord, StepStats, request_record
from workbench.metrics.waste import flatten_breakdown, waste_breakdown

__all__ = [
    "CallbackSink",
    "JsonlSink",
    "Recorder",
    "RequestRecord",
    "StepStats",
    "flatten_breakdown",
    "request_record",
    "waste_breakdown",
]

"""Executors run the model for a schedule. For now: :class:`LocalExecutor` (one process)."""

from workbench.executor.local import LocalExecutor, prepare_inputs

__all__ = ["LocalExecutor", "prepare_inputs"]

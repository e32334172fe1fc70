"""Executors run the model for a schedule: :class:`LocalExecutor` (one process) and
:class:`workbench.executor.tensor_parallel.TensorParallelExecutor` (worker processes over
``torch.distributed``; imported on use, not here)."""

from workbench.executor.local import LocalExecutor, prepare_inputs

__all__ = ["LocalExecutor", "prepare_inputs"]

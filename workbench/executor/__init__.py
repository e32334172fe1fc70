"""Executors run the model for a schedule: :class:`LocalExecutor` (one process) and
:class:`workbench.executor.tensor_parallel.TensorParallelExecutor` (worker processes over
``torch.distributed``; imported on use, not here)."""

from workbench.executor.local import LocalExecutor, prepare_inputs


def make_executor(config):
    """The executor of a real model for ``config`` (an ``EngineConfig``): worker processes when
    ``config.uses_workers``, else this process. It reads the model's files (config, tokenizer,
    weights) here; the model is built by its ``load_model``."""
    if config.uses_workers:
        from workbench.executor.tensor_parallel import TensorParallelExecutor

        return TensorParallelExecutor(config)
    return LocalExecutor(config)


__all__ = ["LocalExecutor", "make_executor", "prepare_inputs"]

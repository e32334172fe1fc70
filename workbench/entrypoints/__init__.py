"""What users call: the offline :class:`~workbench.entrypoints.llm.LLM` (and, next, the server)."""

from workbench.entrypoints.llm import LLM

__all__ = ["LLM"]

"""workbench: an LLM-serving engine (paged KV cache, continuous batching) and a course lab.

from workbench import LLM, SamplingParams
"""

from workbench.config import EngineConfig
from workbench.engine import LLMEngine
from workbench.entrypoints.async_llm import AsyncLLM, AsyncLLMEngine
from workbench.entrypoints.llm import LLM
from workbench.outputs import CompletionOutput, RequestOutput
from workbench.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "AsyncLLM",
    "AsyncLLMEngine",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]

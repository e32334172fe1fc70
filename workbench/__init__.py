"""workbench: an LLM-serving engine (paged KV cache, continuous batching) and a course lab.

from workbench import LLM, SamplingParams
"""

# before anything imports torch: OpenMP reads its spin count when it loads (workbench/omp_wait.py)
from workbench.omp_wait import set_spin_default

set_spin_default()

from workbench.config import EngineConfig  # noqa: E402
from workbench.engine import LLMEngine  # noqa: E402
from workbench.entrypoints.async_llm import AsyncLLM, AsyncLLMEngine  # noqa: E402
from workbench.entrypoints.llm import LLM  # noqa: E402
from workbench.outputs import CompletionOutput, RequestOutput  # noqa: E402
from workbench.sampling import SamplingParams  # noqa: E402

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

"""Engine defaults against vLLM 0.32's: each is vLLM's, or ``--help`` says vLLM's and why it differs here.

vLLM's defaults below are from vLLM 0.32's source (``vllm/engine/arg_utils.py`` ``EngineArgs`` and
``_set_default_max_num_seqs_and_batched_tokens_args``, ``vllm/config/cache.py``), for a CPU server."""

from __future__ import annotations

import dataclasses

from click.testing import CliRunner

from workbench.cli.options import VLLM_DEFAULTS
from workbench.config import EngineConfig

#: vLLM 0.32's resolved default of each engine argument workbench shares, on a CPU, for ``vllm serve``
VLLM_032 = {
    "dtype": "auto",
    "seed": 0,
    "block_size": 16,
    "gpu_memory_utilization": 0.92,
    "max_num_seqs": 128,
    "max_num_queued_reqs": None,
    "max_num_batched_tokens": 2048,
    "max_model_len": "the model's",
    "num_gpu_blocks_override": None,
    "enable_chunked_prefill": True,
    "long_prefill_token_threshold": 0,
    "enable_prefix_caching": True,
    "scheduling_policy": "fcfs",
    "kv_cache_dtype": "auto",
    "kv_cache_memory_bytes": None,
    "tensor_parallel_size": 1,
    "distributed_executor_backend": None,
}


def _ours(name: str):
    f = {f.name: f for f in dataclasses.fields(EngineConfig)}[name]
    return f.default


def test_every_default_is_vllms_or_its_difference_is_explained():
    unexplained = []
    for name, theirs in VLLM_032.items():
        ours = _ours(name)
        if name == "max_num_batched_tokens":  # None resolves to this with chunked prefill on
            ours = EngineConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS
        if name == "max_model_len":  # None: the model's, capped
            ours = f"the model's, capped at {EngineConfig.DEFAULT_MAX_MODEL_LEN}"
        if ours != theirs and name not in VLLM_DEFAULTS:
            unexplained.append(f"{name}: ours {ours!r}, vLLM 0.32 {theirs!r}")
    assert not unexplained, "differences from vLLM without a reason in VLLM_DEFAULTS:\n" + "\n".join(unexplained)


def test_help_states_vllms_default_and_the_reason():
    from workbench.cli.main import main

    text = " ".join(CliRunner().invoke(main, ["serve", "--help"], terminal_width=400).output.split())
    for name in VLLM_DEFAULTS:
        flag = "--" + name.replace("_", "-")
        assert flag in text
        words = " ".join(VLLM_DEFAULTS[name].split())[:40]
        assert words in text, f"{flag}: --help lacks {words!r}"

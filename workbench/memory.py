"""The memory budget: how many KV blocks the device can hold (ARCHITECTURE §3).

    KV budget = capacity × gpu_memory_utilization − weights − activation peak − communication buffers
    num_blocks = KV budget // block bytes,   block bytes = block_size × KV bytes per token

KV bytes per token = 2 (K and V) × num_hidden_layers × num_key_value_heads × head_dim ×
bytes of the KV dtype (vLLM paper, Kwon et al., SOSP 2023, §3; vLLM's
``vllm/utils.get_kv_cache_torch_dtype`` and cache engine).

Capacity: on CUDA the device's total memory (``torch.cuda.mem_get_info``); on CPU the
declared ``device_memory``. The activation peak is an analytical upper bound of the
transient tensors of one forward at ``max_num_batched_tokens`` tokens (the hidden
state, the fused QKV and gate/up outputs, the attention output, and float32 logits
of ``max_num_seqs`` rows); communication buffers are 0 on one device.
``num_gpu_blocks_override`` bypasses the budget, as in vLLM.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


def kv_bytes_per_token(hf_config, kv_dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    """Bytes of K and V for one token across all layers (one rank's share under TP).

    Args:
        hf_config: a transformers config with ``num_hidden_layers``, ``num_key_value_heads``,
            ``num_attention_heads``, ``hidden_size`` and optionally ``head_dim``.
        kv_dtype: dtype of the cache.
        tensor_parallel_size: ranks the KV heads are split across.
    """
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    per_rank_heads = max(1, kv_heads // tensor_parallel_size)
    elem = torch.empty((), dtype=kv_dtype).element_size()
    return 2 * hf_config.num_hidden_layers * per_rank_heads * head_dim * elem


def activation_peak_bytes(hf_config, max_num_batched_tokens: int, max_num_seqs: int, dtype: torch.dtype) -> int:
    """Upper bound (bytes) of one forward's transient tensors; see the module docstring."""
    elem = torch.empty((), dtype=dtype).element_size()
    h = hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    qkv = (hf_config.num_attention_heads + 2 * hf_config.num_key_value_heads) * head_dim
    per_token = (4 * h + qkv + 3 * hf_config.intermediate_size) * elem
    logits = max_num_seqs * hf_config.vocab_size * 4
    return max_num_batched_tokens * per_token + logits


@dataclass
class MemoryBudget:
    """Where the device memory goes, in bytes (and the KV pool in blocks and tokens)."""

    capacity_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    activation_bytes: int
    comm_buffer_bytes: int
    kv_budget_bytes: int
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    max_model_len: int
    source: str  # "cpu device_memory", "cuda", or "num_gpu_blocks_override"

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def kv_pool_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """Sequences of ``max_model_len`` tokens the pool holds at once."""
        return self.kv_pool_tokens / self.max_model_len

    def summary_line(self) -> str:
        mib = 1 << 20
        return (
            f"memory budget ({self.source}): capacity {self.capacity_bytes / mib:,.0f} MiB x "
            f"{self.gpu_memory_utilization} | weights {self.weights_bytes / mib:,.1f} MiB | "
            f"activations {self.activation_bytes / mib:,.1f} MiB | buffers {self.comm_buffer_bytes / mib:,.1f} MiB | "
            f"KV pool {self.kv_pool_bytes / mib:,.1f} MiB = {self.num_blocks:,} blocks x {self.block_size} tokens "
            f"= {self.kv_pool_tokens:,} tokens ({self.kv_bytes_per_token:,} B/token) | "
            f"max concurrency {self.max_concurrency:.2f}x at max_model_len={self.max_model_len}"
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(block_bytes=self.block_bytes, kv_pool_bytes=self.kv_pool_bytes, kv_pool_tokens=self.kv_pool_tokens)
        return d


def plan_memory(
    *,
    hf_config,
    device: torch.device,
    device_memory: int | None,
    gpu_memory_utilization: float,
    weights_bytes: int,
    kv_dtype: torch.dtype,
    act_dtype: torch.dtype,
    block_size: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    num_gpu_blocks_override: int | None = None,
) -> MemoryBudget:
    """Compute the budget and the number of KV blocks.

    Raises:
        ValueError: the budget leaves no room for KV, or the pool cannot hold one
            ``max_model_len`` sequence (names the pool in tokens, the requested length,
            the largest length that fits, and how to fix it).
    """
    per_token = kv_bytes_per_token(hf_config, kv_dtype)
    block_bytes = per_token * block_size
    act = activation_peak_bytes(hf_config, max_num_batched_tokens, max_num_seqs, act_dtype)
    if device.type == "cuda":
        capacity = torch.cuda.mem_get_info(device)[1]
        source = "cuda"
    else:
        capacity = int(device_memory)
        source = "cpu device_memory"
    budget = int(capacity * gpu_memory_utilization) - weights_bytes - act
    if num_gpu_blocks_override is not None:
        num_blocks = num_gpu_blocks_override
        source = "num_gpu_blocks_override"
    else:
        if budget < block_bytes:
            mib = 1 << 20
            enough = (weights_bytes + act + max_model_len * per_token) / gpu_memory_utilization
            raise ValueError(
                f"not enough memory for the KV cache: capacity {capacity / mib:,.0f} MiB x gpu_memory_utilization "
                f"{gpu_memory_utilization} - weights {weights_bytes / mib:,.1f} MiB - activations {act / mib:,.1f} MiB "
                f"= {budget / mib:,.1f} MiB, not even one block. One max_model_len={max_model_len:,} sequence "
                f"needs {max_model_len * per_token / mib:,.1f} MiB: give at least {enough / mib:,.0f} MiB "
                f"(device_memory / gpu_memory_utilization), or lower max_model_len or max_num_batched_tokens"
            )
        num_blocks = budget // block_bytes
    mb = MemoryBudget(
        capacity_bytes=capacity,
        gpu_memory_utilization=gpu_memory_utilization,
        weights_bytes=weights_bytes,
        activation_bytes=act,
        comm_buffer_bytes=0,
        kv_budget_bytes=max(budget, 0),
        kv_bytes_per_token=per_token,
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        source=source,
    )
    if mb.kv_pool_tokens < max_model_len:
        raise ValueError(
            f"the KV pool holds {mb.kv_pool_tokens:,} tokens ({num_blocks:,} blocks x {block_size}), fewer than "
            f"max_model_len={max_model_len:,}: one sequence of that length cannot fit. Set max_model_len <= "
            f"{mb.kv_pool_tokens:,}, or give the KV cache more memory (device_memory, gpu_memory_utilization, "
            f"num_gpu_blocks_override; {max_model_len:,} tokens need {max_model_len * per_token / (1 << 20):,.1f} MiB)"
        )
    return mb

"""The Llama family with paged attention: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Architecture: Touvron et al., "LLaMA" (2023) and "Llama 2" (2023); RMSNorm (Zhang & Sennrich, 2019); RoPE (Su et
al., 2021) in the rotate-half layout of HF transformers; GQA (Ainslie et al., 2023); SwiGLU (Shazeer, 2020). The
RoPE frequencies come from transformers' own ``LlamaRotaryEmbedding`` so that every ``rope_type`` it knows (default,
linear, dynamic, yarn, llama3, ...) matches it.

The model runs a flat batch: all tokens of the step, ``[num_tokens]``, with their positions; K/V are written to and
read from the paged cache through :class:`~workbench.attention.AttentionMetadata`. Q/K/V and gate/up projections are
fused (one matmul each), as in vLLM and Megatron-LM.

Tensor parallelism: built with a :class:`~workbench.model.parallel.TensorParallelGroup`, each layer holds one rank's
shard (column-parallel QKV and gate/up, row-parallel o/down with one all-reduce each, vocab-parallel embedding and
LM head with a gather of logits; see :mod:`workbench.model.parallel`). Without one (``tp=None``) the same layers get
a :class:`~workbench.model.parallel.SingleDeviceGroup`, which communicates nothing: the arithmetic is exactly the
single-device one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.attention import TORCH_BACKEND, AttentionMetadata
from workbench.model.cpu_pack import packed_linear
from workbench.model.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    SingleDeviceGroup,
    TensorParallelGroup,
    VocabParallelEmbedding,
    kv_heads_per_rank,
)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in float32 as HF's LlamaRMSNorm."""

    #: bfloat16 on a CPU: the C++ ops of :mod:`workbench.kernels.cpu_layer_ops` (one pass for the four ops below);
    #: ``None`` (the default, and always in float32): the eager ops. Set by ``use_cpu_layer_ops``.
    fused_ops = None

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_ops is not None:
            return self.fused_ops.rms_norm(x, self.weight, self.eps)
        # torch.rms_norm is x * rsqrt(mean(x^2) + eps) in one kernel (bit-identical to the three ops in float32)
        y = torch.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * y.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, D]`` by the angles of its tokens (``cos``, ``sin``: ``[T, 1, D]``), as transformers'
    ``apply_rotary_pos_emb`` (RoPE in the rotate-half layout; Su et al., 2021, eq. 34)."""
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions ``0 .. max_positions-1``: ``[max_positions, head_dim]``."""

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        hf = LlamaRotaryEmbedding(config)
        inv_freq = hf.inv_freq.float()
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = (inv_freq[:, None] @ pos[None, :]).T  # same op order as transformers
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * hf.attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * hf.attention_scaling, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` of the step's positions ``[T]``: each ``[T, 1, head_dim]`` in ``dtype``. Looked up once
        per step and shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


class LlamaAttention(nn.Module):
    """Grouped-query attention; under TP only this rank's heads (local ``num_heads``, ``num_kv_heads``)."""

    fused_ops = None  # as RMSNorm's: the C++ RoPE in bfloat16 on a CPU

    def __init__(self, config, tp: TensorParallelGroup) -> None:
        super().__init__()
        n = tp.world_size
        self.num_heads = config.num_attention_heads // n
        self.num_kv_heads = kv_heads_per_rank(config.num_key_value_heads, n)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, bias, tp)
        self.scale = self.head_dim**-0.5

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], kv_cache, meta: AttentionMetadata):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k heads sit side by side in the fused output: one rotation for both
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        rotate = apply_rotary if self.fused_ops is None else self.fused_ops.rotary
        q, k = rotate(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        attn = meta.backend or TORCH_BACKEND  # the PyTorch reference or the Triton kernels
        attn.write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
        o = attn.paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU; under tensor parallelism this rank's ``intermediate_size / N`` features."""

    fused_ops = None  # as RMSNorm's: the C++ SiLU(gate) * up in bfloat16 on a CPU

    def __init__(self, config, tp: TensorParallelGroup) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.intermediate_size = config.intermediate_size // tp.world_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = RowParallelLinear(self.intermediate_size, config.hidden_size, bias, tp)

    def forward(self, x):
        if self.fused_ops is not None:
            return self.down_proj(self.fused_ops.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(self, x, rope, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """A Llama-family decoder over a paged KV cache.

    Args:
        config: a transformers ``LlamaConfig`` (or any config with the same fields).
        max_positions: length of the RoPE tables (the engine's ``max_model_len``).
        tp: this rank's tensor-parallel group; ``None`` = the whole model in one process (a
            :class:`~workbench.model.parallel.SingleDeviceGroup`). With several ranks, load a shard
            (:func:`workbench.model.parallel.shard_hf_state_dict`).
    """

    def __init__(self, config, max_positions: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp = tp or SingleDeviceGroup()  # the same layers at every size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:  # under TP: this rank's vocabulary rows, as the embedding's
            self.lm_head = nn.Linear(config.hidden_size, self.embed_tokens.weight.shape[0], bias=False)
        self.packed_lm_head: torch.Tensor | None = None  # bfloat16 on CPU: the LM head in oneDNN's layout (cpu_pack)

    @property
    def layer_glue(self) -> str:
        """How RMSNorm, RoPE and SiLU * up run: the C++ ops (a bfloat16 model on a CPU) or eager torch ops."""
        if self.norm.fused_ops is not None:
            return "C++ (workbench.kernels.cpu_layer_ops: bfloat16 on the CPU; WORKBENCH_CPU_LAYER_OPS=0 for eager ops)"
        return "eager torch ops"

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run the step's tokens; return ``[num_sampling, vocab_size]`` float32 logits of the tokens that sample.

        Args:
            input_ids: ``[num_tokens]`` int64.
            positions: ``[num_tokens]`` int64, each token's position in its sequence.
            kv_caches: per layer ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
            meta: the step's paged-attention layout.
            logits_indices: ``[num_sampling]`` int64, the rows of the tokens that sample.
        """
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        for layer, cache in zip(self.layers, kv_caches):
            x = layer(x, rope, cache, meta)
        x = self.norm(x[logits_indices])
        if self.packed_lm_head is not None:
            logits = packed_linear(x, self.packed_lm_head, None)
        else:
            logits = F.linear(x, self.lm_head_weight)  # [S, ceil(V/N)] per rank -> [S, V] on every rank
        return self.tp.gather_vocab(logits, self.config.vocab_size).float()

    @property
    def packed_head_copy_bytes(self) -> int:
        """Bytes of the packed copy of a tied LM head (``vocab x hidden`` values), 0 where there is none: an
        untied head's dense weight moves to ``meta`` when packed, a tied one is the embedding, which stays dense
        for its lookups (:func:`workbench.model.cpu_pack.prepack_linears`)."""
        if self.packed_lm_head is None or self.lm_head is not None:
            return 0
        head = self.embed_tokens.weight
        return head.numel() * head.element_size()

    def weight_bytes(self) -> int:
        """Bytes of all parameters (a tied LM head counted once) plus :attr:`packed_head_copy_bytes`."""
        return sum(p.numel() * p.element_size() for p in self.parameters()) + self.packed_head_copy_bytes

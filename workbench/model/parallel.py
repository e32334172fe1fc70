"""Megatron-style tensor-parallel layers and the weight sharding that feeds them.

Shoeybi et al., "Megatron-LM" (2019), §3: an MLP ``Y = GeLU(X A) B`` splits ``A`` by
columns (each rank computes its slice of the hidden features, no communication) and ``B``
by rows (each rank a partial sum, one all-reduce); attention splits by heads the same way.
vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` / ``RowParallelLinear`` /
``VocabParallelEmbedding`` / ``ParallelLMHead`` (vllm/model_executor/layers/linear.py,
vocab_parallel_embedding.py) are the model for the shapes here, including the replication
of KV heads when the group is larger than ``num_key_value_heads``.

Per decoder layer, with ``N`` ranks, ``H`` query heads, ``KV`` KV heads and ``I`` the MLP width:

* fused QKV (column-parallel): ``H/N`` query heads and ``max(1, KV/N)`` KV heads per rank;
* ``o_proj`` (row-parallel): input ``H/N x head_dim`` columns, one all-reduce of ``[T, hidden]``;
* fused gate/up (column-parallel): ``I/N`` of each;
* ``down_proj`` (row-parallel): input ``I/N`` columns, one all-reduce of ``[T, hidden]``;
* embedding (vocab-parallel): rows ``[r V', (r+1) V')`` with ``V' = ceil(V / N)``; tokens outside
  a rank's range give zeros there, one all-reduce of ``[T, hidden]``;
* LM head (vocab-parallel, the embedding's shard when tied): ``[S, V']`` logits per rank,
  all-gathered to ``[S, V]``.

A row-parallel bias is added once, after the all-reduce. Every collective goes through a
:class:`TensorParallelGroup`, which counts bytes and time (:class:`~workbench.comm.CommStats`).
In one process without ``torch.distributed`` the same layers take a :class:`SingleDeviceGroup`,
whose collectives do nothing: the model has one code path at every size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.comm import CommStats, Timed
from workbench.model.cpu_pack import packed_linear
from workbench.model.shapes import arch_from_hf_config


class TensorParallelGroup:
    """A rank's view of its tensor-parallel group: rank, size, the ``torch.distributed``
    process group and the communication counters.

    Args:
        rank: this process's rank in the group.
        world_size: ranks in the group.
        group: the process group (``None`` = the default group).
        device: where this rank's tensors live (CUDA collectives are synchronized for timing).
    """

    #: whether the collectives go through ``torch.distributed`` (a group of one rank over a real
    #: process group still does; :class:`SingleDeviceGroup` does not)
    communicates = True

    def __init__(self, rank: int, world_size: int, group=None, device: torch.device | str = "cpu") -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.device = torch.device(device)
        self.stats = CommStats()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` (any shape) over the group, in place; returns it."""
        import torch.distributed as dist

        with Timed(self.stats, "allreduce_bytes", x.numel() * x.element_size(), self.device):
            dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, x: torch.Tensor, full: int) -> torch.Tensor:
        """All-gather ``x [..., D]`` from every rank, concatenate along the last dimension in rank
        order and keep the first ``full`` columns: ``[..., full]`` (drops the vocab padding)."""
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        with Timed(self.stats, "allgather_bytes", x.numel() * x.element_size() * self.world_size, self.device):
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)[..., :full]


class SingleDeviceGroup(TensorParallelGroup):
    """The group of one, without ``torch.distributed``: nothing to sum or gather, so the collectives
    return their input and count nothing, and the parallel layers below are exactly the
    single-device ones (:class:`RowParallelLinear` fuses its bias as ``nn.Linear``; the embedding is
    a plain lookup)."""

    communicates = False

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(0, 1, None, device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_vocab(self, x: torch.Tensor, full: int) -> torch.Tensor:
        return x[..., :full]


def kv_heads_per_rank(num_kv_heads: int, world_size: int) -> int:
    """KV heads each rank holds: ``max(1, KV // N)`` (replicated past ``KV``, as vLLM)."""
    return max(1, num_kv_heads // world_size)


def kv_head_range(num_kv_heads: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[first, last)`` KV heads of ``rank``: a contiguous slice when ``N <= KV``, else the one
    head shared by ranks ``r`` with ``r // (N / KV)`` equal (vLLM's ``QKVParallelLinear``)."""
    if world_size <= num_kv_heads:
        per = num_kv_heads // world_size
        return rank * per, (rank + 1) * per
    head = rank // (world_size // num_kv_heads)
    return head, head + 1


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """``(start, end, rows)`` of ``rank``'s vocabulary shard: ``rows = ceil(V / N)``; the last
    shard's rows past ``V`` are padding (zero weights)."""
    rows = -(-vocab_size // world_size)
    start = min(rank * rows, vocab_size)
    return start, min(start + rows, vocab_size), rows


class ColumnParallelLinear(nn.Linear):
    """``y_r = x W_r^T (+ b_r)``: this rank's slice of the output features; no communication
    (Megatron's column-parallel linear with ``gather_output=False``).

    Args:
        in_features: full input width; out_features: this rank's output width.
    Shapes: ``x [T, in_features]`` -> ``[T, out_features]``.
    """

    packed_weight: torch.Tensor | None = None  # bfloat16 on CPU: oneDNN's layout (workbench.model.cpu_pack)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum_r x_r W_r^T + b``: each rank multiplies its slice of the input features, one
    all-reduce sums the partial products, the bias (held whole by every rank) is added once.

    Args:
        in_features: this rank's input width; out_features: full output width.
        bias: whether there is a bias.
        tp: the group to all-reduce over.
    Shapes: ``x [T, in_features]`` -> ``[T, out_features]``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    packed_weight: torch.Tensor | None = None  # bfloat16 on CPU: oneDNN's layout (workbench.model.cpu_pack)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.communicates:  # nothing to sum: the bias fused, as nn.Linear (same bits)
            return self._matmul(x, self.bias)
        y = self.tp.all_reduce(self._matmul(x, None))
        return y if self.bias is None else y + self.bias

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, bias)
        return F.linear(x, self.weight, bias)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (vocabulary) are split across ranks (:func:`vocab_range`).

    Each rank looks up the token ids in its range, writes zeros for the others, and one
    all-reduce assembles ``[T, hidden]``. ``weight`` is ``[ceil(V / N), hidden]``.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.start, self.end, rows = vocab_range(vocab_size, tp.rank, tp.world_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.communicates:  # the whole vocabulary: a plain lookup
            return F.embedding(ids, self.weight)
        inside = (ids >= self.start) & (ids < self.end)
        local = torch.where(inside, ids - self.start, torch.zeros_like(ids))
        x = F.embedding(local, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(x)


def shard_hf_state_dict(sd: dict[str, torch.Tensor], config, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """``rank``'s slice of a transformers Llama state dict, under the same names.

    Query heads, KV heads (:func:`kv_head_range`), gate/up rows and the vocabulary
    (:func:`vocab_range`, zero-padded) are split by output rows; ``o_proj`` and ``down_proj``
    by input columns; norms and row-parallel biases are kept whole.

    Raises:
        ValueError: ``world_size`` does not split the model (see :func:`check_tensor_parallel`).
    """
    check_tensor_parallel(config, world_size)
    h, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // h
    qh = h // world_size
    q0, q1 = rank * qh * d, (rank + 1) * qh * d
    k_lo, k_hi = kv_head_range(kv, rank, world_size)
    k0, k1 = k_lo * d, k_hi * d
    inter = config.intermediate_size // world_size
    i0, i1 = rank * inter, (rank + 1) * inter
    v_start, v_end, rows = vocab_range(config.vocab_size, rank, world_size)

    def vocab_rows(w: torch.Tensor) -> torch.Tensor:
        part = w[v_start:v_end]
        if part.shape[0] < rows:
            part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
        return part

    out: dict[str, torch.Tensor] = {}
    for name, w in sd.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = vocab_rows(w)
        elif name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
            out[name] = w[q0:q1]
        elif any(name.endswith(f"self_attn.{p}_proj.{t}") for p in "kv" for t in ("weight", "bias")):
            out[name] = w[k0:k1]
        elif name.endswith("self_attn.o_proj.weight"):
            out[name] = w[:, q0:q1]
        elif any(name.endswith(f"mlp.{p}_proj.{t}") for p in ("gate", "up") for t in ("weight", "bias")):
            out[name] = w[i0:i1]
        elif name.endswith("mlp.down_proj.weight"):
            out[name] = w[:, i0:i1]
        else:  # norms, row-parallel biases
            out[name] = w
    return {k: v.contiguous() for k, v in out.items()}


def valid_tensor_parallel_sizes(config, limit: int = 64) -> list[int]:
    """Group sizes up to ``limit`` that split ``config`` (the rules of :func:`check_tensor_parallel`)."""
    return arch_from_hf_config(config, _name(config), "").valid_tensor_parallel_sizes(limit)


def check_tensor_parallel(config, tensor_parallel_size: int, name: str | None = None) -> None:
    """Refuse a ``tensor_parallel_size`` the model cannot be split by — vLLM's rules, shared with
    ``workbench kv-calc`` (:meth:`workbench.catalog.ModelArch.check_tensor_parallel`):
    ``num_attention_heads`` and ``intermediate_size`` divisible by it, and
    ``num_key_value_heads`` divisible by it or it by ``num_key_value_heads`` (heads replicated).

    Raises:
        ValueError: names the model (``name``, else its config's path), its head counts, MLP width
            and the valid sizes.
    """
    arch_from_hf_config(config, name or _name(config), "").check_tensor_parallel(tensor_parallel_size)


def _name(config) -> str:
    return str(getattr(config, "_name_or_path", "") or getattr(config, "model_type", "model") or "model")

"""Prepacked bfloat16 weights for the CPU's matmuls.

On a CPU, PyTorch runs a bfloat16 ``F.linear`` through oneDNN, which first reorders the weight ``[out, in]`` into
its blocked layout for the CPU's bfloat16 instructions (AVX512-BF16 or AMX tiles) — on every call. Reordering once,
when the model is built, and calling oneDNN with the packed weight (``torch.ops.mkldnn._reorder_linear_weight`` and
``_linear_pointwise``, what ``torch.compile``'s CPU backend emits with weight freezing, and what Intel's extension
for PyTorch and vLLM's CPU backend do) skips that work: the same products, bit for bit, sooner (most at decode's
small batches; see docs/benchmarks.md, section "Prepacked weights and the LM head").

Only bfloat16 on CPU: float32 matmuls go through MKL's ``sgemm`` (no reorder to save, and the float32 reference
must stay bit-identical to transformers). The packed weight replaces the dense one, whose parameter is left on the
``meta`` device, so that the weights are not held twice: the model's weight bytes are counted as before. What that
means for code that reaches into the model: such a parameter has its shape and dtype but no values — reading it
gives meta tensors (``.cpu()``, ``.item()`` and ``.numpy()`` raise), ``state_dict()`` holds meta tensors for these
projections, and writing into it changes nothing the engine computes with. Load weights before the model is built
(:func:`workbench.model.loader.build_model`), or run with ``dtype="float32"``, which keeps dense weights.
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.cpu_dtype import env_switch

#: token count the packed layout is tuned for (a full decode batch); any count works
PACK_BATCH_HINT = 64


def can_prepack(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether :func:`prepack_linears` applies: bfloat16 on a CPU, with PyTorch's oneDNN ops present and oneDNN's
    bfloat16 path supported by this CPU (it needs AVX512 BW/VL/DQ or AVX-NE-CONVERT; on an AVX2-only CPU the reorder
    raises, and ``F.linear`` runs bfloat16 emulated instead)."""
    mkldnn = torch.ops.mkldnn
    return (
        dtype == torch.bfloat16
        and torch.device(device).type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
        and (not hasattr(mkldnn, "_is_mkldnn_bf16_supported") or bool(mkldnn._is_mkldnn_bf16_supported()))
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` (bfloat16, CPU) in oneDNN's blocked layout (an opaque ``torch._mkldnn`` tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [T, in] @ W^T (+ bias)`` with ``W`` packed by :func:`pack_weight`: ``[T, out]``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_lm_head_enabled() -> bool:
    """``WORKBENCH_CPU_PACK_LM_HEAD`` (:func:`workbench.cpu_dtype.env_switch`): unset or on packs the LM head,
    ``0`` keeps it dense (the benchmarks' baseline). Raises ``ValueError`` naming any other value; the loader asks
    in every dtype, so a typo is refused in float32 too, where nothing is packed."""
    return env_switch("WORKBENCH_CPU_PACK_LM_HEAD", default=True)


def prepack_linears(model: nn.Module, pack_head: bool = True) -> int:
    """Pack the weight of every module with a ``packed_weight`` slot (the model's QKV, O, gate/up and down
    projections) and move its dense parameter to ``meta``; then, when ``pack_head`` (the loader passes
    :func:`pack_lm_head_enabled`), the LM head into the model's ``packed_lm_head``. An untied LM head's dense weight
    goes to ``meta`` too; a tied one is the embedding's, which lookups read, so the packed one is a copy (the model's
    ``packed_head_copy_bytes``, which ``weight_bytes`` counts). Returns how many weights were packed.

    The LM head is the step's largest product (``[sampling rows, hidden] x [hidden, vocab]``); it is packed
    because the packed product is faster at the shapes a step samples (``benchmarks/offline_throughput.py``'s
    matmul part; see docs/benchmarks.md, section "Prepacked weights and the LM head")."""
    n = 0
    for m in model.modules():
        if hasattr(m, "packed_weight") and m.packed_weight is None:
            m.packed_weight = pack_weight(m.weight)
            m.weight = nn.Parameter(m.weight.detach().to("meta"), requires_grad=False)
            n += 1
    if pack_head and getattr(model, "packed_lm_head", False) is None:
        model.packed_lm_head = pack_weight(model.lm_head_weight)
        if model.lm_head is not None:
            model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().to("meta"), requires_grad=False)
        n += 1
    return n

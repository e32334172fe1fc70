"""The element-wise glue of a Llama layer in C++ for bfloat16 on the CPU (``cpu_layer_ops.cpp``): RMSNorm, RoPE and
SiLU(gate) * up, one pass each instead of the eager model's several ops.

Built into the same extension as the C++ decode-attention kernel (:func:`workbench.kernels.cpu_attention.load`).
:func:`use_cpu_layer_ops` hands them to a bfloat16 model on the CPU (``workbench.model.loader.build_model`` calls
it, beside the weight prepacking of :mod:`workbench.model.cpu_pack`); float32 keeps the eager ops, which the suite
and the labs compare bit for bit with transformers. Each op rounds to bfloat16 where the eager ops round, so the
two differ only where a float32 sum or ``exp`` taken in another order tips a rounding: by one bfloat16 step, two
where a product follows (``tests/test_cpu_attention.py``: over 99% of elements equal). ``WORKBENCH_CPU_LAYER_OPS=0`` keeps the eager ops (the benchmarks' baseline).
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.cpu_dtype import env_switch


def _ext():
    from workbench.kernels import cpu_attention  # imported on use: `python -m workbench.kernels.cpu_attention` runs it

    return cpu_attention.load()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last dim; ``x [..., H]``, ``weight [H]``, both bfloat16."""
    return _ext().rms_norm(x.contiguous(), weight.contiguous(), float(eps))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused projection ``[..., 2 I]`` (gate first): ``[..., I]``, bfloat16."""
    return _ext().silu_and_mul(gate_up.contiguous())


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x [T, heads, D]`` (rotate-half layout) by ``cos``, ``sin`` ``[T, 1, D]``: a new ``[T, heads, D]``.
    ``x`` may be a view into a wider row (the fused QKV output) if each token's heads are contiguous."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return _ext().rotary(x, cos.contiguous(), sin.contiguous())


def enabled(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a model in ``dtype`` on ``device`` takes these ops: bfloat16 on a CPU, the extension built or
    buildable here, and ``WORKBENCH_CPU_LAYER_OPS`` not off (:func:`workbench.cpu_dtype.env_switch`; any other
    value raises ``ValueError``)."""
    from workbench.kernels import cpu_attention

    on = env_switch("WORKBENCH_CPU_LAYER_OPS", default=True)  # asked in every dtype: a typo is refused anywhere
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return False
    if not on or cpu_attention.toolchain_missing():
        return False
    try:
        cpu_attention.load()
    except Exception:  # noqa: BLE001 - a failed build: the eager ops (the attention backend's log says why)
        return False
    return True


def use_cpu_layer_ops(model: nn.Module) -> int:
    """Give every module with a ``fused_ops`` slot (RMSNorm, attention, MLP of :mod:`workbench.model.llama`) this
    module; returns how many took it."""
    import sys

    n = 0
    for m in model.modules():
        if hasattr(m, "fused_ops"):
            m.fused_ops = sys.modules[__name__]
            n += 1
    return n

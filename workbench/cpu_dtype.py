"""What ``dtype="auto"`` means on this machine: bfloat16 on a CPU with native bfloat16, float32 elsewhere."""

from __future__ import annotations

import functools
import os

import torch

#: the spellings of an on/off environment switch (any case, surrounding spaces ignored); unset or empty: the default
SWITCH_ON = ("1", "true", "yes", "on")
SWITCH_OFF = ("0", "false", "no", "off")


def env_switch(name: str, default: bool | None) -> bool | None:
    """The on/off environment switch ``name`` (``WORKBENCH_CPU_BFLOAT16``, ``WORKBENCH_CPU_PACK_LM_HEAD``,
    ``WORKBENCH_CPU_CHUNK_KERNEL``, ``WORKBENCH_CPU_LAYER_OPS``): unset or empty gives ``default``, a spelling in
    :data:`SWITCH_ON` / :data:`SWITCH_OFF` gives ``True`` / ``False``. Raises ``ValueError`` naming any other value
    and the accepted ones, so that a typo is not taken for the default."""
    raw = os.environ.get(name)
    value = (raw or "").strip().lower()
    if value == "":
        return default
    if value in SWITCH_ON or value in SWITCH_OFF:
        return value in SWITCH_ON
    raise ValueError(
        f"{name}={raw!r} is not an on/off switch: set it to {' / '.join(SWITCH_ON)} (on) or {' / '.join(SWITCH_OFF)}"
        f" (off), in any case, or unset it for the default ({_DEFAULT_WORDS[default]})"
    )


#: how a refusal names each switch's default: on, off, or the CPU's own answer (WORKBENCH_CPU_BFLOAT16)
_DEFAULT_WORDS = {True: "on", False: "off", None: "chosen from the CPU's features"}


_DTYPES = {
    **dict.fromkeys(("float32", "fp32", "float"), torch.float32),
    **dict.fromkeys(("bfloat16", "bf16"), torch.bfloat16),
    **dict.fromkeys(("float16", "fp16", "half"), torch.float16),
}


def cpu_native_bfloat16() -> str | None:
    """The CPU's native bfloat16 instructions, or ``None``: ``"AMX"`` (Intel AMX-BF16 tiles, Sapphire Rapids and
    later), ``"AVX512-BF16"`` (AVX512_BF16 dot products: AMD Zen 4 and later, Intel Cooper Lake, Sapphire Rapids),
    else ``None`` (bfloat16 would be emulated in float32 and run slower than float32 itself).

    Read from the ``flags`` line of ``/proc/cpuinfo`` (Linux; ``None`` elsewhere). The same test vLLM's CPU
    backend makes before it picks bfloat16 (``vllm/platforms/cpu.py``). The environment variable
    ``WORKBENCH_CPU_BFLOAT16`` overrides the answer (:func:`env_switch`): ``0`` = none (the test suite sets it, so
    that its compared outputs are float32 on every CPU), ``1`` = native; any other value raises ``ValueError``."""
    forced = env_switch("WORKBENCH_CPU_BFLOAT16", default=None)  # None: not set, ask the CPU
    if forced is not None:
        return "WORKBENCH_CPU_BFLOAT16=1" if forced else None
    flags = _cpu_flags()
    return "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else None


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def auto_dtype(device: torch.device | str = "cpu") -> tuple[torch.dtype, str]:
    """What ``dtype="auto"`` means on ``device``, and why (the sentence the engine logs at start-up).

    CPU: bfloat16 where the CPU has native bfloat16 (:func:`cpu_native_bfloat16`: its matmuls run
    several times faster than float32 ones and its KV cache takes half the bytes; see docs/benchmarks.md, section
    "bfloat16 against float32"), else float32, as vLLM's
    CPU backend.
    Other devices: float32 (the engine's reference precision; pass ``dtype="bfloat16"`` or ``"float16"``)."""
    if torch.device(device).type != "cpu":
        return torch.float32, f"dtype auto -> float32 on {torch.device(device).type} (pass --dtype to change it)"
    isa = cpu_native_bfloat16()
    forced = (os.environ.get("WORKBENCH_CPU_BFLOAT16") or "").strip()
    if forced:  # the override decided, not the CPU: say so
        dtype = torch.bfloat16 if isa else torch.float32
        name = str(dtype).removeprefix("torch.")
        return dtype, f"dtype auto -> {name}: set by WORKBENCH_CPU_BFLOAT16={forced} (the CPU was not asked)"
    if isa:
        return (
            torch.bfloat16,
            f"dtype auto -> bfloat16: this CPU has native bfloat16 ({isa}); --dtype float32 for exact float32",
        )
    return torch.float32, (
        "dtype auto -> float32: this CPU has no native bfloat16 (AVX512-BF16 or AMX), where bfloat16 would be "
        "emulated and slower; --dtype bfloat16 forces it"
    )


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """Map a dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``, ``"auto"``) to a torch dtype.

    ``"auto"`` follows the hardware of ``device`` (:func:`auto_dtype`): on CPU bfloat16 where it is native,
    float32 elsewhere.

    Raises:
        ValueError: the name is not one of the accepted ones.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype(device)[0]
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype={dtype!r} is not supported; use one of 'auto', 'float32', 'bfloat16', 'float16'"
        ) from None

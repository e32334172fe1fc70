"""Triton kernels for paged attention, cache writes and block copies, each beside its PyTorch reference.

| module | kernels | PyTorch reference (:mod:`workbench.kernels.reference`) |
|---|---|---|
| :mod:`workbench.kernels.paged_attention` | decode attention, single pass and split-KV (+ its merge) | ``paged_decode_attention_ref`` |
| :mod:`workbench.kernels.prefill_attention` | causal attention of a chunk of new tokens over a paged context | ``paged_prefill_attention_ref`` |
| :mod:`workbench.kernels.cache_ops` | ``reshape_and_cache``, ``copy_blocks``, ``gather_blocks`` / ``scatter_blocks`` (swap) | ``*_ref`` |

The engine reaches them through :mod:`workbench.attention` (backend ``"triton"`` on CUDA,
``"triton-interpret"`` anywhere). This package itself never imports Triton, so a CPU-only
install without Triton imports ``workbench.kernels`` and ``workbench.kernels.reference`` fine; the kernel modules
need Triton (``pip install triton``, or the ``triton`` extra of this project).

**Compiled or interpreted.** Every kernel wrapper takes ``interpret``: ``None`` (default) runs
the compiled kernel on CUDA tensors and Triton's interpreter (NumPy, on the CPU) on CPU tensors;
``True`` forces the interpreter. Triton's own switch, ``TRITON_INTERPRET=1``
(``triton.knobs.runtime.interpret``), is read when a function is decorated with ``@triton.jit``,
including Triton's library (``tl.max``, ``tl.sum``, ...) when ``triton.language`` is first imported
— and PyTorch imports Triton by itself (``torch._dynamo`` does, e.g. when transformers builds a
model). So setting it later has no effect, and a process that wants both modes could not have them.
:mod:`workbench.kernels.runtime` therefore launches a kernel in the interpreter by wrapping its Python
function in Triton's ``InterpretedFunction`` and swapping Triton's library functions for
interpreted ones during the launch. With ``TRITON_INTERPRET=1`` set before Triton's first import,
every kernel is interpreted (Triton's documented mode) and compiled launches are refused.
"""

from __future__ import annotations

import importlib.util
import os
import sys

_TRUTHY = ("1", "true", "on", "yes")


def triton_available() -> bool:
    """True when Triton is installed (does not import it)."""
    if sys.modules.get("triton") is not None:
        return True
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # sys.modules["triton"] = None blocks it (as tests do)
        return False


def triton_loaded() -> bool:
    """True once ``triton.language`` has been imported in this process."""
    return "triton.language" in sys.modules


def interpreter_forced() -> bool:
    """True when Triton runs (or, once imported, will run) *every* kernel in its interpreter:
    ``TRITON_INTERPRET=1`` was set when Triton was first imported (or is set now, before that)."""
    if not triton_loaded():
        return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUTHY
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    # Triton's library was decorated at import: its type tells the process-wide mode for good
    return isinstance(standard.max, InterpretedFunction)


def load_triton():
    """Import and return the ``triton`` module.

    Raises:
        ImportError: Triton is not installed (names the fix: ``pip install triton``).
    """
    if not triton_available():
        raise ImportError(
            "Triton is not installed; `pip install triton` (or `pip install -e '.[triton]'`), "
            "or use the PyTorch reference backend (attention_backend='torch')"
        )
    import triton
    import triton.language  # noqa: F401

    return triton


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (>= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()

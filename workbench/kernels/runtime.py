"""Launching a kernel compiled (CUDA) or in Triton's interpreter (CPU), in the same process.

:func:`launch` is what the kernel wrappers call instead of ``kernel[grid](...)``. For the
interpreter it builds Triton's ``InterpretedFunction`` from the kernel's Python source (the same
object ``@triton.jit`` returns under ``TRITON_INTERPRET=1``) and, for the duration of the launch,
replaces the ``@triton.jit`` functions of ``triton.language`` (``tl.max``, ``tl.sum``, ``tl.cdiv``,
...) with interpreted twins, because a compiled library function cannot be called from interpreted
code. Everything is restored afterwards; launches are serialised by a lock. See the package
docstring for why this is needed (Triton fixes its mode at first import, and torch imports it).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from workbench.kernels import load_triton

triton = load_triton()
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

try:  # imported lazily by Triton's argument handling; import it while the library is untouched
    import triton.experimental.gluon  # noqa: F401
except Exception:  # noqa: BLE001 - absent or different in other Triton versions: nothing to pre-import
    pass

_LOCK = threading.RLock()
_INTERPRETED: dict = {}  # python function -> InterpretedFunction
_LIBRARY = [m for m in (tl, getattr(tl, "standard", None), getattr(tl, "math", None), getattr(tl, "core", None)) if m]


def process_interprets() -> bool:
    """True when Triton was imported with ``TRITON_INTERPRET=1``: every ``@triton.jit`` is interpreted."""
    return isinstance(getattr(tl.standard, "max", None), InterpretedFunction)


def _interpreted(fn) -> InterpretedFunction:
    if fn not in _INTERPRETED:
        _INTERPRETED[fn] = InterpretedFunction(fn)
    return _INTERPRETED[fn]


@contextlib.contextmanager
def _interpreted_library():
    """Swap every compiled ``@triton.jit`` function of ``triton.language`` for an interpreted one."""
    saved = []
    try:
        for mod in _LIBRARY:
            for name, value in list(vars(mod).items()):
                if isinstance(value, JITFunction):
                    saved.append((mod, name, value))
                    setattr(mod, name, _interpreted(value.fn))
        yield
    finally:
        for mod, name, value in reversed(saved):
            setattr(mod, name, value)


def wants_interpreter(tensor: torch.Tensor, interpret: bool | None) -> bool:
    """The launch mode: ``interpret`` if given, else the interpreter for non-CUDA tensors.

    Raises:
        RuntimeError: compiled mode asked for CPU tensors, or for CUDA while ``TRITON_INTERPRET=1``
            made every kernel interpreted.
    """
    if interpret is None:
        interpret = tensor.device.type != "cuda"
    if not interpret:
        if tensor.device.type != "cuda":
            raise RuntimeError(
                f"compiled Triton kernels need CUDA tensors, got {tensor.device}; use interpret=True "
                "(attention_backend='triton-interpret') to run them in Triton's interpreter"
            )
        if process_interprets():
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set when Triton was imported, so every kernel runs in the interpreter; "
                "unset it (in a new process) for compiled kernels, or pass interpret=True"
            )
    return interpret


def launch(kernel, grid: tuple[int, ...], *args, interpret: bool, **meta) -> None:
    """Run ``kernel[grid](*args, **meta)`` compiled, or in Triton's interpreter when ``interpret``."""
    if not interpret or isinstance(kernel, InterpretedFunction):
        kernel[grid](*args, **meta)
        return
    with _LOCK, _interpreted_library():
        _interpreted(kernel.fn)[grid](*args, **meta)

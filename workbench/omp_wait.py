"""How long torch's OpenMP threads spin before they sleep: ``GOMP_SPINCOUNT``, set before torch loads.

The CPU build of torch runs its intra-op work (matmuls through oneDNN and MKL, elementwise ops, the C++ kernels'
``at::parallel_for``) on GNU OpenMP threads. Between two parallel regions, and at the barrier that ends one, a thread
that has nothing to do spins for ``GOMP_SPINCOUNT`` iterations (300,000 by default, about a millisecond) before it
sleeps, so that the next region starts without a wake-up. On an idle machine that is the right trade. On a shared
one it is not: a thread spins on a core while the partner it waits for is descheduled, the spinning takes the core
from the partner or from the other process, and every region waits longer. Beside busy processes on
the same cores, a job with OpenMP's default spin takes several times its idle time and burns more CPU time.

A short spin keeps the idle speed (the gaps between a step's regions are a few microseconds to tens of
microseconds) and, beside other work, sleeps before it wastes the core: :data:`OMP_SPIN_COUNT` iterations.
``OMP_WAIT_POLICY=PASSIVE`` (no spin at all) wastes nothing but slows the idle job: every region then
starts with a wake-up. See docs/benchmarks.md, section "The engine beside other work".

GNU OpenMP reads these variables once, when the library loads, that is when torch is first imported: so
``workbench`` sets the default at import, before it imports torch, and only where the user set neither
``GOMP_SPINCOUNT`` nor ``OMP_WAIT_POLICY``. Child processes (tensor-parallel workers, servers, notebook kernels
started from here) inherit it. A program that imports torch before workbench keeps OpenMP's own default
(:func:`spin_default_applied` says whether it took effect). ``GOMP_SPINCOUNT=300000`` restores OpenMP's own
default for one command.

The spin count holds only while OpenMP's threads are no more than the CPUs. GNU OpenMP keeps one team of workers
for every thread that has started a parallel region, and once the threads of all teams outnumber the CPUs it cuts
every wait to a short throttled spin (``gomp_throttled_spin_count_var``), which on a busy step is the same as no spin.
So a process that runs torch on two threads (a server's main thread that loaded the model, and the engine thread
that steps it) runs every small op with a wake-up; :class:`~workbench.entrypoints.async_llm.AsyncLLM` therefore
builds its engine on the thread that steps it.

Only GNU OpenMP (libgomp, which torch's Linux x86 wheels use) reads ``GOMP_SPINCOUNT``; under another OpenMP runtime
the variable is set and has no effect.
"""

from __future__ import annotations

import os
import sys

#: Spin iterations before an idle OpenMP thread sleeps (GNU OpenMP's ``GOMP_SPINCOUNT``; its own default: 300,000).
OMP_SPIN_COUNT = 3000

_applied: bool | None = None


def set_spin_default() -> bool:
    """Set ``GOMP_SPINCOUNT`` to :data:`OMP_SPIN_COUNT` unless the user chose a spin count or a wait policy, or
    torch (and with it OpenMP) is already loaded; returns whether this process's OpenMP will run with it."""
    global _applied
    if _applied is None:
        torch_loaded = "torch" in sys.modules
        if not torch_loaded and "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
            os.environ["GOMP_SPINCOUNT"] = str(OMP_SPIN_COUNT)
        _applied = (
            not torch_loaded
            and os.environ.get("GOMP_SPINCOUNT") == str(OMP_SPIN_COUNT)
            and "OMP_WAIT_POLICY" not in os.environ
        )
    return _applied


def spin_default_applied() -> bool:
    """Whether this process's OpenMP runs with :data:`OMP_SPIN_COUNT` (set by workbench before torch loaded)."""
    return bool(_applied)

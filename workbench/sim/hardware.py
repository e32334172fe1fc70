"""Hardware catalogue of the simulator: what a step's cost depends on, per device, with sources.

Figures are the vendors' datasheet figures for the SXM (or the only) form factor:

* ``peak_flops``: dense fp16 / bf16 tensor-core FLOP/s, *without* the 2:4 sparsity factor that
  datasheets also print (e.g. A100: 312 TFLOPS dense, "624*" with sparsity);
* ``hbm_bandwidth``: device memory bandwidth, bytes/s;
* ``link_bandwidth``: GPU-to-GPU bandwidth in one direction, bytes/s — half the datasheet's
  total (bidirectional) NVLink figure, or one direction of the PCIe slot for cards without
  NVLink; a ring all-reduce moves data in one direction around the ring;
* ``link_latency_s``: latency of one hop of a ring collective. Datasheets do not state it; the
  catalogue uses 2 µs per NVLink hop and 5 µs per PCIe hop: the order of magnitude of NCCL's
  tuning model (``src/graph/tuning.cc``: hardware latencies of about 1 µs per NVLink hop and 2 µs
  per PCIe hop, plus a few µs of protocol overhead per step), labelled as assumptions in
  ``link_source``.

Capacity (``memory_bytes``) follows :mod:`workbench.catalog`'s convention (datasheet GB read
as GiB) and, for the GPUs ``workbench kv-calc`` knows, is taken from its ``GPUS`` entry so that
the simulator's memory budget and ``kv-calc`` agree to the byte.

:func:`cpu_profile` measures this machine instead (a matmul probe for FLOP/s, a tensor copy
for memory bandwidth), for calibration against real CPU runs of the bundled model.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace

from workbench.catalog import GPUS, GiB

TB = 10**12
GB = 10**9


@dataclass(frozen=True)
class HardwareSpec:
    """One device of a simulated server.

    Attributes:
        name: catalogue name (``"A100-80GB"``).
        memory_bytes: capacity of one device (bytes).
        peak_flops: dense fp16/bf16 FLOP/s (float32 FLOP/s for a CPU profile).
        hbm_bandwidth: device memory bandwidth (bytes/s).
        link_bandwidth: one-direction GPU-to-GPU bandwidth (bytes/s) of ``interconnect``.
        link_latency_s: latency of one ring hop (s).
        interconnect: ``"NVLink"``, ``"PCIe"`` or ``"none"``.
        source: datasheet (URL) of capacity, FLOP/s and bandwidth.
        link_source: where the link figures come from.
        host_bandwidth: device <-> host bandwidth in one direction (bytes/s; PCIe slot, datasheet):
            what swapping KV blocks out and in costs.
    """

    name: str
    memory_bytes: int
    peak_flops: float
    hbm_bandwidth: float
    link_bandwidth: float
    link_latency_s: float
    interconnect: str
    source: str
    link_source: str = ""
    host_bandwidth: float = 32 * GB

    def with_changes(self, **kw) -> HardwareSpec:
        """A copy with some figures changed (e.g. ``hbm_bandwidth=2 * spec.hbm_bandwidth``)."""
        return replace(self, **kw)

    def to_dict(self) -> dict:
        return asdict(self)


_A100 = GPUS["A100-80GB"].source
_H100 = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_H200 = "https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446"
_L4 = "https://nvdam.widen.net/s/rvq98gbwsw/l4-datasheet-2595652"
_T4 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf"
_V100 = "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"
_NVLINK = "half the datasheet's total NVLink bandwidth; hop latency: assumption, NCCL tuning.cc order of magnitude"
_PCIE = "one direction of the PCIe slot (datasheet); hop latency: assumption, NCCL tuning.cc order of magnitude"

#: The catalogue, by name.
HARDWARE: dict[str, HardwareSpec] = {
    h.name: h
    for h in [
        HardwareSpec("A100-40GB", GPUS["A100-40GB"].memory_bytes, 312 * TB, 1555 * GB, 300 * GB, 2e-6, "NVLink",
                     _A100, _NVLINK),
        HardwareSpec("A100-80GB", GPUS["A100-80GB"].memory_bytes, 312 * TB, 2039 * GB, 300 * GB, 2e-6, "NVLink",
                     _A100, _NVLINK),
        HardwareSpec("H100-80GB", GPUS["H100-80GB"].memory_bytes, 989.4 * TB, 3350 * GB, 450 * GB, 2e-6, "NVLink",
                     _H100 + " (H100 SXM)", _NVLINK, 64 * GB),
        HardwareSpec("H200", GPUS["H200"].memory_bytes, 989.4 * TB, 4800 * GB, 450 * GB, 2e-6, "NVLink",
                     _H200 + " (H200 SXM)", _NVLINK, 64 * GB),
        HardwareSpec("L4", GPUS["L4"].memory_bytes, 121 * TB, 300 * GB, 32 * GB, 5e-6, "PCIe", _L4,
                     "PCIe Gen4 x16, 64 GB/s total; " + _PCIE),
        HardwareSpec("T4", 16 * GiB, 65 * TB, 320 * GB, 16 * GB, 5e-6, "PCIe", _T4,
                     "PCIe Gen3 x16, 32 GB/s total; " + _PCIE, 16 * GB),
        HardwareSpec("V100-32GB", 32 * GiB, 125 * TB, 900 * GB, 150 * GB, 2e-6, "NVLink", _V100 + " (V100 SXM2)",
                     _NVLINK, 16 * GB),
    ]
}  # fmt: skip

_ALIASES = {"h100": "H100-80GB", "h100sxm": "H100-80GB", "h100sxm80gb": "H100-80GB", "v100": "V100-32GB"}


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name.lower())


def find_hardware(name: str) -> HardwareSpec:
    """The device called ``name`` (case, ``-``, ``_`` and spaces ignored), or ``"cpu"`` for :func:`cpu_profile`.

    Raises:
        ValueError: not in the catalogue (names the catalogue).
    """
    if _key(name) == "cpu":
        return cpu_profile()
    k = _key(_ALIASES.get(_key(name), name))
    for n, h in HARDWARE.items():
        if _key(n) == k:
            return h
    raise ValueError(f"gpu={name!r} is not in the simulator's catalogue; use one of {', '.join(HARDWARE)} or 'cpu'")


_CPU: HardwareSpec | None = None


def cpu_profile(memory_bytes: int = 2 * GiB, repeats: int = 3) -> HardwareSpec:
    """This machine's CPU as a :class:`HardwareSpec`, measured once per process.

    ``peak_flops``: best of ``repeats`` float32 ``1024 x 1024`` matmuls (2·n³ FLOP each) on
    PyTorch's threads; ``hbm_bandwidth``: best of ``repeats`` copies of a 64 MiB tensor (read +
    write = 2 × 64 MiB moved). ``memory_bytes`` is the engine's default ``device_memory`` on CPU.
    No interconnect (one device). These are probes, not peaks: the calibration's efficiency
    factors absorb the gap to what a model forward reaches.
    """
    global _CPU
    if _CPU is None:
        import time

        import torch

        n = 1024
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        best = min(_timed(lambda: torch.mm(a, b), time) for _ in range(repeats))
        flops = 2 * n**3 / best
        src = torch.empty(16 << 20)  # 64 MiB of float32
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = min(_timed(lambda: dst.copy_(src), time) for _ in range(repeats))
        bw = 2 * src.numel() * 4 / best
        _CPU = HardwareSpec(
            "cpu", memory_bytes, flops, bw, 0.0, 0.0, "none",
            "measured: workbench.sim.hardware.cpu_profile (matmul and copy probes)", "", bw / 2,
        )  # fmt: skip
    return replace(_CPU, memory_bytes=memory_bytes)


def _timed(fn, time) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0

"""Communication of a tensor-parallel group: the per-step counters and a model of NCCL's buffers.

**Counters** (:class:`CommStats`): every collective the tensor-parallel layers issue is timed
and its payload counted, on the rank that runs the engine (rank 0). The time of a collective
includes the wait for the slowest rank to arrive — on a machine where the ranks share CPU
cores that wait is most of it. Bytes are the size of the tensor handed to the collective on
one rank, not the bytes on the wire: a ring all-reduce of ``S`` bytes sends
``2 (N - 1) / N x S`` bytes out of each rank (NCCL tests, "Performance reported by NCCL
tests", https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).

**NCCL buffer model** (:func:`nccl_buffer_bytes`): device memory a rank's NCCL communicator
keeps for its connections. NCCL gives every *channel* its own connection to each peer of
the algorithm, and every connection one buffer per *protocol* (Simple, LL, LL128); the
buffer lives on one side of the connection, so a rank holds one set per incoming
connection:

    bytes per rank = nchannels x peers(algorithm, group size) x sum over enabled protocols of buffsize(protocol)

* Simple: ``NCCL_BUFFSIZE``, default 4 MiB = 4,194,304 B ("Controls the size of the buffer
  used by NCCL when communicating data between pairs of GPUs", NCCL environment variables,
  https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-buffsize).
* LL: ``NCCL_LL_BUFFSIZE``, default ``NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS x NCCL_STEPS
  x sizeof(ncclLLFifoLine)`` = 8 x 512 x 8 x 16 = 524,288 B.
* LL128: ``NCCL_LL128_BUFFSIZE``, default ``NCCL_LL128_ELEMS_PER_THREAD x NCCL_LL128_MAX_NTHREADS
  x NCCL_STEPS x 8`` = 120 x 640 x 8 x 8 = 4,915,200 B (``DEFAULT_LL_BUFFSIZE``,
  ``DEFAULT_LL128_BUFFSIZE``, ``DEFAULT_BUFFSIZE`` in NCCL's ``src/init.cc``,
  https://github.com/NVIDIA/nccl/blob/master/src/init.cc). LL128 is only enabled on
  hardware that supports it (NVLink, Volta or newer); ``NCCL_PROTO`` restricts the set.
* Channels: NCCL picks them from the topology, between ``NCCL_MIN_NCHANNELS`` and
  ``NCCL_MAX_NCHANNELS`` (env.html#nccl-min-nchannels, #nccl-max-nchannels); the model takes
  the count as an input (:data:`DEFAULT_NCHANNELS` when none is given).
* Peers: a ring has one incoming connection per channel (from the previous rank); a tree
  (a chain inside one node) up to two (parent and child). Since NCCL 2.22 connections are
  made at the first use of an algorithm (``NCCL_RUNTIME_CONNECT``), so a group that only
  ever runs ring all-reduces holds ring buffers only. A group of one rank has no peer and
  no buffer.

It leaves out what does not scale with these knobs (the communicator's work FIFO, proxy
state, the CUDA context itself); on CUDA the engine measures instead of modelling
(:mod:`workbench.executor.tensor_parallel`), and that measurement includes them.

**Custom all-reduce model** (:func:`custom_all_reduce_bytes`): the IPC buffers of a one-shot /
two-shot all-reduce that reads the peers' memory over NVLink, as vLLM's ``CustomAllreduce``
(``vllm/distributed/device_communicators/custom_all_reduce.py``; its kernels in
``csrc/custom_all_reduce.cuh``). Each rank allocates, before the memory profile:

* a metadata buffer of ``meta_size() + max_size`` bytes (the synchronisation ``Signal`` and a
  temporary buffer for the two-shot algorithm's intermediate results), shared over CUDA IPC;
* a data buffer of ``max_size`` bytes (eager-mode inputs are copied into it), shared over IPC;
* ``rank_data``, 8 MiB of device memory for the tables of registered peer pointers.

``max_size`` is 8 MiB (``8192 * 1024``, the constructor's default); an all-reduce whose message
is ``max_size`` bytes or more goes to NCCL. ``meta_size()`` is ``sizeof(vllm::Signal)``: two
``[36][8]`` ``uint32`` flag arrays and one ``[36]``, each aligned to 128 B = 2,560 B. The peers'
buffers a rank maps over IPC are the peers' memory, not its own. vLLM enables it for groups of
2, 4, 6 or 8 ranks on one node, and for more than two only when every pair is connected by
NVLink ("not supported on more than two PCIe-only GPUs"); ``disable_custom_all_reduce=True``
(an engine argument) turns it off and its buffers with it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields

import torch

#: ``NCCL_BUFFSIZE`` default (bytes): the Simple protocol's buffer per connection.
NCCL_DEFAULT_BUFFSIZE = 4 * 1024 * 1024
#: ``NCCL_LL_BUFFSIZE`` default (bytes) = 8 lines x 512 threads x 8 steps x 16 B.
NCCL_DEFAULT_LL_BUFFSIZE = 8 * 512 * 8 * 16
#: ``NCCL_LL128_BUFFSIZE`` default (bytes) = 120 elements x 640 threads x 8 steps x 8 B.
NCCL_DEFAULT_LL128_BUFFSIZE = 120 * 640 * 8 * 8
#: Protocols NCCL knows (``NCCL_PROTO`` accepts a comma-separated subset, or ``^`` + a subset to exclude).
NCCL_PROTOCOLS = ("LL", "LL128", "Simple")
#: Channels assumed when none is given: 2, what NCCL's ring search gives between two GPUs
#: on PCIe; NVLink systems get more (up to ``NCCL_MAX_NCHANNELS``). An assumption, stated as such.
DEFAULT_NCHANNELS = 2
#: Most channels accepted: NCCL's ``MAXCHANNELS`` (``src/include/device.h``) is 32 in the 2.x
#: releases checked, raised to 64 in later ones; values above a release's own limit are clamped by NCCL.
NCCL_MAX_CHANNELS = 64
#: Algorithms whose connections the model counts.
NCCL_ALGORITHMS = ("ring", "tree")


def parse_nccl_proto(proto: str | None) -> tuple[str, ...]:
    """The protocols an ``NCCL_PROTO`` value enables (``None`` = all three).

    ``"Simple"``, ``"LL,LL128"``, ``"^LL128"`` (all but LL128); case-insensitive, as NCCL.

    Raises:
        ValueError: an unknown protocol name (names the valid ones), or a value enabling none.
    """
    if proto is None or not str(proto).strip():
        return NCCL_PROTOCOLS
    text = str(proto).strip()
    exclude = text.startswith("^")
    names = [n.strip() for n in text.lstrip("^").split(",") if n.strip()]
    canon = {p.lower(): p for p in NCCL_PROTOCOLS}
    bad = [n for n in names if n.lower() not in canon]
    if bad or not names:
        raise ValueError(
            f"NCCL_PROTO={proto!r}: unknown protocol {bad[0] if bad else '(none)'!r}; use a comma-separated "
            f"subset of {', '.join(NCCL_PROTOCOLS)} (or ^ and a subset to exclude), e.g. 'Simple' or '^LL128'"
        )
    chosen = {canon[n.lower()] for n in names}
    out = tuple(p for p in NCCL_PROTOCOLS if (p not in chosen) == exclude)
    if not out:
        raise ValueError(f"NCCL_PROTO={proto!r} leaves no protocol enabled; keep at least one of {NCCL_PROTOCOLS}")
    return out


def nccl_peers(group_size: int, algorithm: str = "ring") -> int:
    """Incoming connections per channel of one rank: ring 1; tree (a chain in one node) 2, or
    1 with two ranks; ``"ring+tree"`` both; 0 in a group of one."""
    if group_size < 2:
        return 0
    n = 0
    for algo in algorithm.split("+"):
        if algo == "ring":
            n += 1
        elif algo == "tree":
            n += min(2, group_size - 1)
        else:
            raise ValueError(f"algorithm={algorithm!r}: use 'ring', 'tree' or 'ring+tree'")
    return n


@dataclass(frozen=True)
class NcclBufferEstimate:
    """The model's answer, in bytes (see the module docstring for the formula and sources).

    Attributes:
        per_rank_bytes: buffers one rank holds; total_bytes: the whole group's.
        per_connection_bytes: sum of the enabled protocols' buffers of one connection.
    """

    group_size: int
    nchannels: int
    peers: int
    protocols: tuple[str, ...]
    buffsize: int
    ll_buffsize: int
    ll128_buffsize: int
    per_connection_bytes: int
    per_rank_bytes: int
    total_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def nccl_buffer_bytes(
    group_size: int,
    buffsize: int | None = None,
    nchannels: int | None = None,
    protocols: str | tuple[str, ...] | None = None,
    algorithm: str = "ring",
    ll_buffsize: int | None = None,
    ll128_buffsize: int | None = None,
    min_nchannels: int | None = None,
    max_nchannels: int | None = None,
) -> NcclBufferEstimate:
    """Modelled NCCL communication-buffer bytes of a tensor-parallel group (module docstring).

    Args:
        group_size: ranks in the communicator (``tensor_parallel_size``).
        buffsize: ``NCCL_BUFFSIZE`` (bytes; default 4 MiB).
        nchannels: channels NCCL uses; ``None`` = :data:`DEFAULT_NCHANNELS`, clamped to
            ``[min_nchannels, max_nchannels]`` (``NCCL_MIN_NCHANNELS`` / ``NCCL_MAX_NCHANNELS``).
        protocols: ``NCCL_PROTO`` (a string as NCCL takes it) or a tuple of protocol names;
            ``None`` = all three.
        algorithm: ``"ring"`` (the default: what large all-reduces use), ``"tree"`` or ``"ring+tree"``.
        ll_buffsize, ll128_buffsize: ``NCCL_LL_BUFFSIZE`` / ``NCCL_LL128_BUFFSIZE`` (bytes).

    Raises:
        ValueError: a non-positive size or count, ``min_nchannels > max_nchannels``, an unknown protocol.
    """
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be an integer >= 1 (ranks)")
    sizes = {
        "NCCL_BUFFSIZE": NCCL_DEFAULT_BUFFSIZE if buffsize is None else buffsize,
        "NCCL_LL_BUFFSIZE": NCCL_DEFAULT_LL_BUFFSIZE if ll_buffsize is None else ll_buffsize,
        "NCCL_LL128_BUFFSIZE": NCCL_DEFAULT_LL128_BUFFSIZE if ll128_buffsize is None else ll128_buffsize,
    }
    for name, v in sizes.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive number of bytes, e.g. {NCCL_DEFAULT_BUFFSIZE}")
    lo = 1 if min_nchannels is None else min_nchannels
    hi = NCCL_MAX_CHANNELS if max_nchannels is None else max_nchannels
    if lo > hi:
        raise ValueError(f"NCCL_MIN_NCHANNELS={lo} > NCCL_MAX_NCHANNELS={hi}; make the minimum <= the maximum")
    ch = DEFAULT_NCHANNELS if nchannels is None else nchannels
    if not isinstance(ch, int) or ch < 1:
        raise ValueError(f"nchannels={ch!r} must be an integer >= 1")
    ch = max(lo, min(hi, ch))
    protos = parse_nccl_proto(protocols) if protocols is None or isinstance(protocols, str) else tuple(protocols)
    per_proto = {
        "Simple": sizes["NCCL_BUFFSIZE"],
        "LL": sizes["NCCL_LL_BUFFSIZE"],
        "LL128": sizes["NCCL_LL128_BUFFSIZE"],
    }
    per_conn = sum(per_proto[p] for p in protos)
    peers = nccl_peers(group_size, algorithm)
    per_rank = ch * peers * per_conn
    return NcclBufferEstimate(
        group_size=group_size,
        nchannels=ch,
        peers=peers,
        protocols=protos,
        buffsize=sizes["NCCL_BUFFSIZE"],
        ll_buffsize=sizes["NCCL_LL_BUFFSIZE"],
        ll128_buffsize=sizes["NCCL_LL128_BUFFSIZE"],
        per_connection_bytes=per_conn,
        per_rank_bytes=per_rank,
        total_bytes=per_rank * group_size,
    )


#: vLLM ``CustomAllreduce``'s default ``max_size`` (bytes): larger all-reduces go to NCCL.
CUSTOM_AR_MAX_SIZE = 8192 * 1024
#: ``sizeof(vllm::Signal)`` (``ops.meta_size()``): start[36][8], end[36][8], _flag[36] uint32, 128-B aligned.
CUSTOM_AR_META_BYTES = 2 * 36 * 8 * 4 + 256
#: ``rank_data``: device memory for the registered buffers' peer-pointer tables (8 MiB in vLLM).
CUSTOM_AR_RANK_DATA_BYTES = 8 * 1024 * 1024
#: group sizes vLLM's custom all-reduce supports (``CustomAllreduce._SUPPORTED_WORLD_SIZES``).
CUSTOM_AR_WORLD_SIZES = (2, 4, 6, 8)


@dataclass(frozen=True)
class CustomAllReduceEstimate:
    """One rank's custom all-reduce buffers, in bytes (the module docstring has the sources).

    Attributes:
        enabled: whether the group would run it; ``reason``: why not, in vLLM's words, when it would not.
        meta_bytes: ``meta_size() + max_size`` (the shared signal + temporary buffer).
        buffer_bytes: ``max_size`` (the shared eager-mode input buffer).
        rank_data_bytes: the peer-pointer tables (8 MiB).
        per_rank_bytes: their sum, 0 when not enabled.
    """

    group_size: int
    enabled: bool
    reason: str
    max_size: int
    meta_bytes: int
    buffer_bytes: int
    rank_data_bytes: int
    per_rank_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def custom_all_reduce_bytes(
    group_size: int,
    fully_connected: bool = True,
    disabled: bool = False,
    max_size: int | None = None,
) -> CustomAllReduceEstimate:
    """Device memory one rank's custom all-reduce holds (vLLM's ``CustomAllreduce``; module docstring).

    Args:
        group_size: ranks in the tensor-parallel group (one node).
        fully_connected: every pair of GPUs has an NVLink path (NVLink / NVSwitch); ``False`` = PCIe.
        disabled: ``disable_custom_all_reduce=True``.
        max_size: the largest message it takes (bytes; default 8 MiB).

    Raises:
        ValueError: ``group_size < 1`` or ``max_size`` not a positive multiple of 16 bytes (the kernels
            move 16-byte packets).
    """
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be an integer >= 1 (ranks)")
    size = CUSTOM_AR_MAX_SIZE if max_size is None else max_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 16 or size % 16:
        raise ValueError(f"max_size={size!r} must be a positive multiple of 16 bytes, e.g. {CUSTOM_AR_MAX_SIZE}")
    reason = ""
    if disabled:
        reason = "disable_custom_all_reduce=True"
    elif group_size == 1:
        reason = "one rank: nothing to reduce"
    elif group_size not in CUSTOM_AR_WORLD_SIZES:
        reason = f"unsupported world size {group_size} (supported: {', '.join(map(str, CUSTOM_AR_WORLD_SIZES))})"
    elif group_size > 2 and not fully_connected:
        reason = "not supported on more than two PCIe-only GPUs"
    on = not reason
    meta, buf, rank_data = CUSTOM_AR_META_BYTES + size, size, CUSTOM_AR_RANK_DATA_BYTES
    return CustomAllReduceEstimate(
        group_size=group_size,
        enabled=on,
        reason=reason,
        max_size=size,
        meta_bytes=meta if on else 0,
        buffer_bytes=buf if on else 0,
        rank_data_bytes=rank_data if on else 0,
        per_rank_bytes=meta + buf + rank_data if on else 0,
    )


@dataclass
class CommStats:
    """Cumulative collective counters of one rank (bytes = payload per rank; seconds = wall time
    in the collective, waiting for the other ranks included).

    Attributes:
        allreduce_bytes: bytes all-reduced (row-parallel outputs, the vocab-parallel embedding).
        allgather_bytes: bytes all-gathered (the LM head's logits), the gathered output's size.
        broadcast_bytes: bytes of step messages rank 0 sent (pickled schedule inputs).
        num_collectives: collectives issued.
        comm_time_s: seconds spent in all of them.
    """

    allreduce_bytes: int = 0
    allgather_bytes: int = 0
    broadcast_bytes: int = 0
    num_collectives: int = 0
    comm_time_s: float = 0.0

    def copy(self) -> CommStats:
        return CommStats(**asdict(self))

    def since(self, before: CommStats) -> CommStats:
        """The counters accumulated after ``before`` (a :meth:`copy` taken earlier)."""
        return CommStats(**{f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self)})

    def to_dict(self) -> dict:
        return asdict(self)


class Timed:
    """Context manager adding one collective's time (and bytes, by kind) to a :class:`CommStats`.

    On CUDA it synchronizes the device before and after, so the time is the collective's own
    (NCCL runs asynchronously on a stream), at the cost of two synchronizations per collective.
    """

    __slots__ = ("stats", "kind", "nbytes", "cuda", "t0")

    def __init__(self, stats: CommStats, kind: str, nbytes: int, device: torch.device) -> None:
        self.stats, self.kind, self.nbytes = stats, kind, nbytes
        self.cuda = device.type == "cuda"

    def __enter__(self) -> Timed:
        if self.cuda:
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda and exc[0] is None:
            torch.cuda.synchronize()
        s = self.stats
        s.comm_time_s += time.perf_counter() - self.t0
        s.num_collectives += 1
        setattr(s, self.kind, getattr(s, self.kind) + self.nbytes)

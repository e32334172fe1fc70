"""Per-step cost model of the simulator: FLOPs, bytes moved, roofline, tensor-parallel all-reduce.

For one step of one tensor-parallel rank (``N = tensor_parallel_size``), with ``T`` tokens
scheduled (prefill chunks ``(start s, length n)`` and decode tokens of context ``c``, the new
token included) and ``S`` sequences sampling::

    FLOPs   = 2 · T · P_lin  +  2 · S · P_head  +  4 · L · (H_q / N) · d · A
    A       = Σ_decode c  +  Σ_prefill (n · s + n (n + 1) / 2)        (query-key pairs, causal)
    bytes   = W  +  b_kv · (Σ_decode c + Σ_prefill (s + n))  +  b_kv · T
    compute = FLOPs / (peak_flops · e_compute)
    memory  = bytes / (hbm_bandwidth · e_memory)
    comm    = (2 L + 1) · [ 2 (N − 1) · α  +  2 (N − 1) / N · (T · h · elem) / (link_bandwidth · e_link) ]
              + (N − 1) · α  +  (N − 1) / N · (S · V_N · elem) / (link_bandwidth · e_link)     (N > 1)
    swap    = blocks swapped · block bytes / host_bandwidth  +  2 · copied blocks · block bytes / hbm_bandwidth
    step    = overhead + per_seq · (sequences scheduled) + max(compute, memory) + comm + swap

* ``P_lin``: parameters of the rank's linear layers (q/k/v/o and gate/up/down,
  :meth:`workbench.catalog.ModelArch.param_breakdown`): a matmul costs 2 FLOPs per
  multiply-accumulate (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", §2.1:
  C_forward ≈ 2N per token); ``P_head``: the rank's LM-head rows (``ceil(vocab / N) · h``), run
  only for the sampling tokens.
* Attention: QKᵀ and PV cost 2 · d FLOPs each per query-key pair and head (FlashAttention,
  Dao et al. 2022, §3.2 counts 4 · N² · d per head for full attention); a causal prefill chunk
  of ``n`` tokens after ``s`` cached ones has ``n · s + n (n + 1) / 2`` pairs.
* Bytes: the rank's weights ``W`` are read once per step (every token of the batch shares
  them); each decode token reads its whole context's K/V (``b_kv`` = KV bytes per token per
  rank, docs/architecture.md §3), a prefill chunk reads its context once (a FlashAttention-style
  kernel keeps the query tile on chip); every new token's K/V is written once.
* Roofline (Williams, Waterman, Patterson, CACM 2009): a step is bound by the slower of compute
  and memory traffic; ``e_compute`` and ``e_memory`` are the fractions of peak a real forward
  reaches (fitted by :mod:`workbench.sim.calibrate`).
* Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, §3): one all-reduce of the hidden
  state ``T · h`` after attention and one after the MLP per layer, plus one after the
  vocab-parallel embedding (each rank holds ``1 / N`` of the vocabulary's rows: vLLM's
  ``VocabParallelEmbedding``, and :mod:`workbench.model.parallel`); a ring all-reduce takes
  ``2 (N − 1)`` steps, each moving ``1 / N`` of the message over one link and paying one hop
  latency α (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms"; NCCL's ring).
  The LM head's logits ``[S, V_N / N]`` per rank are all-gathered (``V_N`` = vocabulary padded
  to a multiple of ``N``): a ring all-gather is ``N − 1`` such steps. Communication is not
  overlapped with compute, as in vLLM's forward.
* ``overhead`` and ``per_seq``: the engine's CPU time per step (scheduling, input preparation,
  sampling, kernel launches) — constant and per scheduled sequence.

No tensor is created: a step costs O(number of scheduled sequences) of Python arithmetic.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from workbench.catalog import ModelArch
from workbench.sim.hardware import HardwareSpec

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


@dataclass
class Efficiency:
    """The cost model's free parameters (what :mod:`workbench.sim.calibrate` fits).

    Attributes:
        compute: fraction of ``peak_flops`` a forward reaches, in (0, 1].
        memory: fraction of ``hbm_bandwidth`` a forward reaches, in (0, 1].
        link: fraction of ``link_bandwidth`` an all-reduce reaches, in (0, 1].
        overhead_s: fixed CPU time per step (s).
        per_seq_s: CPU time per scheduled sequence (s).
        source: where the values come from (``"default"`` or the calibration that fitted them).

    The defaults are uncalibrated assumptions for GPUs (about 60 % of peak FLOP/s and 80 % of
    HBM bandwidth for large matmuls and streaming reads, 75 % of NVLink for NCCL's ring — the
    ratio of NCCL's measured bus bandwidth to the link figure on A100 — and a few ms of engine
    time per step); calibrate to replace them.

    Raises:
        ValueError: a fraction outside (0, 1] or a negative time.
    """

    compute: float = 0.6
    memory: float = 0.8
    link: float = 0.75
    overhead_s: float = 2e-3
    per_seq_s: float = 1e-5
    source: str = "default (uncalibrated)"

    def __post_init__(self) -> None:
        for k in ("compute", "memory", "link"):
            v = getattr(self, k)
            if not 0 < v <= 1:
                raise ValueError(f"efficiency {k}={v} must be in (0, 1]; it is a fraction of the peak")
        for k in ("overhead_s", "per_seq_s"):
            if getattr(self, k) < 0:
                raise ValueError(f"{k}={getattr(self, k)} must be >= 0 seconds")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class StepShape:
    """What one step computes, per sequence.

    Attributes:
        prefill: ``(start, n)`` per multi-token chunk: ``n`` tokens after ``start`` cached ones.
        decode: context length (tokens, the new one included) of each one-token sequence.
        num_sampling: sequences that sample a token this step.
        swap_blocks: KV blocks copied between device and host (out + in).
        copied_blocks: KV blocks copied on the device (copy-on-write).
        block_size: tokens per KV block (prices the block copies).
    """

    prefill: list[tuple[int, int]] = field(default_factory=list)
    decode: list[int] = field(default_factory=list)
    num_sampling: int = 0
    swap_blocks: int = 0
    copied_blocks: int = 0
    block_size: int = 16

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefill) + len(self.decode)


@dataclass
class StepCost:
    """Time of one step and its parts (seconds), with the FLOPs and bytes behind them (one rank)."""

    time_s: float
    compute_s: float
    memory_s: float
    comm_s: float
    swap_s: float
    overhead_s: float
    flops: float
    bytes: float

    @property
    def bound(self) -> str:
        """``"compute"`` or ``"memory"``: which side of the roofline the step sits on."""
        return "compute" if self.compute_s >= self.memory_s else "memory"


class CostModel:
    """Step times of ``arch`` on ``tensor_parallel_size`` devices ``hw`` (module docstring).

    Args:
        arch: the model's architecture (catalogue entry or a config read by ``kv-calc``).
        hw: one device.
        tensor_parallel_size: devices the model is split over (Megatron-style).
        dtype: weights' and activations' dtype name (``float16``, ``bfloat16``, ``float32``).
        kv_cache_dtype: ``auto`` (= ``dtype``) or a dtype name (``fp8`` too).
        efficiency: the free parameters.

    Raises:
        ValueError: a tensor-parallel size that does not split the model, a TP group on a
            device without interconnect, or an unknown dtype.
    """

    def __init__(
        self,
        arch: ModelArch,
        hw: HardwareSpec,
        tensor_parallel_size: int = 1,
        dtype: str = "float16",
        kv_cache_dtype: str = "auto",
        efficiency: Efficiency | None = None,
    ) -> None:
        tp = tensor_parallel_size
        arch.check_tensor_parallel(tp)
        if tp > 1 and hw.link_bandwidth <= 0:
            raise ValueError(
                f"tensor_parallel_size={tp} needs a GPU-to-GPU link, but {hw.name} has none; use a GPU "
                "from the catalogue or tensor_parallel_size=1"
            )
        kv_name = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
        for what, name in (("dtype", dtype), ("kv_cache_dtype", kv_name)):
            if name not in DTYPE_BYTES:
                raise ValueError(f"{what}={name!r} is not supported; use one of {', '.join(DTYPE_BYTES)}")
        self.arch, self.hw, self.tp = arch, hw, tp
        self.eff = efficiency or Efficiency()
        self.elem = DTYPE_BYTES[dtype]
        parts = arch.param_breakdown(tp)
        self.linear_params = parts["attention"] + parts["mlp"]
        self.head_params = -(-arch.vocab_size // tp) * arch.hidden_size
        self.weights_bytes = arch.num_params(tp) * self.elem
        self.kv_bytes_per_token = (
            2 * arch.num_hidden_layers * arch.kv_heads_per_rank(tp) * arch.head_dim * DTYPE_BYTES[kv_name]
        )
        self.attn_flops_per_pair = 4 * arch.num_hidden_layers * (arch.num_attention_heads // tp) * arch.head_dim
        self._hop = 2 * (tp - 1)
        self.padded_vocab = -(-arch.vocab_size // tp) * tp

    def set_efficiency(self, eff: Efficiency) -> None:
        self.eff = eff

    def allreduce_s(self, message_bytes: float) -> float:
        """One ring all-reduce of ``message_bytes`` over the group (0 on one device)."""
        if self.tp == 1:
            return 0.0
        hw = self.hw
        return self._hop * hw.link_latency_s + self._hop / self.tp * message_bytes / (hw.link_bandwidth * self.eff.link)

    def allgather_s(self, total_bytes: float) -> float:
        """One ring all-gather whose result is ``total_bytes`` on every rank (0 on one device)."""
        if self.tp == 1:
            return 0.0
        hw = self.hw
        hops = self.tp - 1
        return hops * hw.link_latency_s + hops / self.tp * total_bytes / (hw.link_bandwidth * self.eff.link)

    def comm_bytes(self, num_tokens: int, num_sampling: int) -> tuple[int, int, int]:
        """``(all-reduced bytes, all-gathered bytes, collectives)`` of one step on one rank, counted as
        :class:`workbench.comm.CommStats` counts the real engine's (0s on one device)."""
        if self.tp == 1:
            return 0, 0, 0
        reduced = (2 * self.arch.num_hidden_layers + 1) * num_tokens * self.arch.hidden_size * self.elem
        gathered = num_sampling * self.padded_vocab * self.elem
        return reduced, gathered, 2 * self.arch.num_hidden_layers + 1 + (1 if num_sampling else 0)

    def step(self, shape: StepShape) -> StepCost:
        """The time of one step (see the module docstring)."""
        return self.step_from_sums(
            num_tokens=shape.num_tokens,
            num_seqs=len(shape.prefill) + len(shape.decode),
            num_sampling=shape.num_sampling,
            pairs=sum(shape.decode) + sum(n * s + n * (n + 1) // 2 for s, n in shape.prefill),
            kv_read_tokens=sum(shape.decode) + sum(s + n for s, n in shape.prefill),
            swap_blocks=shape.swap_blocks,
            copied_blocks=shape.copied_blocks,
            block_bytes=self.kv_bytes_per_token * shape.block_size,
        )

    def copy_s(self, swap_blocks: int, copied_blocks: int, block_bytes: int) -> float:
        """Seconds of block copies: ``swap_blocks`` across the host link, ``copied_blocks`` on the device (each
        read and written once through HBM), ``block_bytes`` each."""
        hw = self.hw
        return swap_blocks * block_bytes / hw.host_bandwidth + 2 * copied_blocks * block_bytes / hw.hbm_bandwidth

    def step_from_sums(
        self,
        *,
        num_tokens: int,
        num_seqs: int,
        num_sampling: int,
        pairs: float,
        kv_read_tokens: float,
        swap_blocks: int = 0,
        copied_blocks: int = 0,
        block_bytes: int = 0,
    ) -> StepCost:
        """The same from the sums the formulas use: tokens ``T``, sequences, sampling sequences ``S``,
        query-key pairs ``A``, KV tokens read; ``block_bytes`` prices the block copies."""
        e, hw = self.eff, self.hw
        flops = 2.0 * num_tokens * self.linear_params + 2.0 * num_sampling * self.head_params
        flops += self.attn_flops_per_pair * pairs
        nbytes = self.weights_bytes + self.kv_bytes_per_token * (kv_read_tokens + num_tokens)
        compute = flops / (hw.peak_flops * e.compute)
        memory = nbytes / (hw.hbm_bandwidth * e.memory)
        comm = 0.0
        if self.tp > 1:
            comm = (2 * self.arch.num_hidden_layers + 1) * self.allreduce_s(
                num_tokens * self.arch.hidden_size * self.elem
            )
            if num_sampling:
                comm += self.allgather_s(num_sampling * self.padded_vocab * self.elem)
        swap = self.copy_s(swap_blocks, copied_blocks, block_bytes) if swap_blocks or copied_blocks else 0.0
        over = e.overhead_s + e.per_seq_s * num_seqs
        return StepCost(over + max(compute, memory) + comm + swap, compute, memory, comm, swap, over, flops, nbytes)

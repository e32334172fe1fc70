"""The simulated engine: the real engine, scheduler and KV manager, with a cost model for an
executor and a simulated clock (docs/architecture.md §5).

:class:`SimEngine` is :class:`~workbench.engine.LLMEngine` given a :class:`SimulatedExecutor` and a
:class:`SimClock`: the same construction and validation, the same scheduler, KV managers, request
bookkeeping, step and records (StepStats with the settled waste breakdown, request records), so a
simulated run folder reads like a real one. What differs:

* the executor is :class:`SimulatedExecutor`: for each ``SchedulerOutput`` it returns the step's
  duration from :class:`~workbench.sim.cost.CostModel` and one token per sampling sequence — the
  end-of-sequence token when the trace says the request ends there, else token 0;
* the clock is simulated: a step that starts at ``t`` ends at ``t + duration``; arrivals,
  first-scheduled, first-token and finish times (so TTFT, TPOT, ITL, e2e) are simulated seconds;
  when nothing runs the clock jumps to the next arrival;
* the memory budget is :func:`workbench.memory.plan_memory` on the simulated device's capacity
  with the model's weights per rank, an activation reserve and the NCCL buffers of the
  tensor-parallel group — the same arithmetic as ``workbench kv-calc``.
"""

from __future__ import annotations

import gc
import logging
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from workbench.catalog import ModelArch
from workbench.config import EngineConfig
from workbench.engine import LLMEngine
from workbench.executor.local import ModelRunnerOutput
from workbench.memory import MemoryBudget, activation_peak_bytes, plan_memory
from workbench.metrics import CallbackSink, Recorder
from workbench.sampling import SamplingParams
from workbench.scheduler import SchedulerOutput
from workbench.sim.cost import DTYPE_BYTES, CostModel, Efficiency, StepCost, StepShape
from workbench.sim.hardware import HardwareSpec
from workbench.sim.trace import TraceRequest

log = logging.getLogger("workbench")

#: token id the simulator samples for a request's end-of-sequence
SIM_EOS = 1
#: first prompt token of shared prefix ``k`` is ``PREFIX_TOKEN_BASE + k``: above every per-request first token
#: (``2 + counter % 1_000_000_007``), so a shared prefix never matches a request's own tokens
PREFIX_TOKEN_BASE = 2_000_000_000
_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def comm_buffer_bytes(
    tensor_parallel_size: int, nchannels: int | None = None, config: EngineConfig | None = None
) -> int:
    """Device memory of one rank's NCCL buffers (0 on one device).

    The one call site of the communication-buffer model (:func:`workbench.comm.nccl_buffer_bytes`:
    ring algorithm, ``nchannels`` channels); ``NCCL_BUFFSIZE``, ``NCCL_PROTO`` and the channel
    bounds come from the engine arguments ``nccl_buffsize``, ``nccl_proto``,
    ``nccl_min_nchannels`` / ``nccl_max_nchannels`` when the config has them (NCCL's defaults otherwise).
    """
    if tensor_parallel_size < 2:
        return 0
    from workbench.comm import nccl_buffer_bytes

    kw = {}
    for arg, name in (
        ("buffsize", "nccl_buffsize"),
        ("protocols", "nccl_proto"),
        ("min_nchannels", "nccl_min_nchannels"),
        ("max_nchannels", "nccl_max_nchannels"),
    ):
        v = getattr(config, name, None)
        if v is not None:
            kw[arg] = v
    return nccl_buffer_bytes(tensor_parallel_size, nchannels=nchannels, **kw).per_rank_bytes


@dataclass
class _SimComm:
    """A step's simulated collectives, in the shape of :class:`workbench.comm.CommStats` (its ``to_dict``)."""

    allreduce_bytes: int
    allgather_bytes: int
    num_collectives: int
    comm_time_s: float

    def to_dict(self) -> dict:
        return {
            "allreduce_bytes": self.allreduce_bytes,
            "allgather_bytes": self.allgather_bytes,
            "num_collectives": self.num_collectives,
            "comm_time_s": self.comm_time_s,
        }


@dataclass
class SimSpec:
    """What is simulated: a model on ``tensor_parallel_size`` devices of one kind.

    Attributes:
        arch: the model (``workbench.catalog.MODELS`` entry, or any config ``kv-calc`` reads).
        hardware: one device (:data:`workbench.sim.hardware.HARDWARE` entry or a CPU profile).
        tensor_parallel_size: devices the model is split over.
        dtype: weights' dtype name (``float16``, ``bfloat16``, ``float32``).
        kv_cache_dtype: ``auto`` (= ``dtype``), a dtype name, or ``fp8``.
        efficiency: the cost model's parameters (default: uncalibrated, see :class:`Efficiency`).
        activation_bytes: memory per device kept for activations; ``None`` = the analytical
            estimate of one forward at ``max_num_batched_tokens`` (``kv-calc --activation-reserve
            estimate``: :func:`workbench.memory.activation_peak_bytes`).
        nccl_nchannels: channels of the NCCL buffer model (``None``: its default).
        custom_all_reduce: the group also holds a custom all-reduce's IPC buffers, as vLLM's
            (:func:`workbench.comm.custom_all_reduce_bytes`: 24 MiB per rank where vLLM would
            enable it — 2, 4, 6 or 8 ranks, NVLink for more than two); ``False`` = as vLLM with
            ``disable_custom_all_reduce=True``. Counted with the communication buffers.
    """

    arch: ModelArch
    hardware: HardwareSpec
    tensor_parallel_size: int = 1
    dtype: str = "float16"
    kv_cache_dtype: str = "auto"
    efficiency: Efficiency = field(default_factory=Efficiency)
    activation_bytes: int | None = None
    nccl_nchannels: int | None = None
    custom_all_reduce: bool = False


class SimClock:
    """Simulated seconds, from 0: the clock stands still while the engine schedules and records;
    :class:`SimulatedExecutor` advances it by each step's priced duration."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now = self.now + seconds

    def jump_to(self, t: float) -> None:
        """Idle until ``t`` (no-op when it is past)."""
        self.now = max(self.now, t)


class SimulatedExecutor:
    """The executor of a simulated run: no weights, no tensors (docs/architecture.md §5).

    Prices each step with the cost model, advances the clock by its duration, and "samples" one
    token per sampling sequence: :data:`SIM_EOS` where the request's trace length says it ends
    (``stop_at``), else token 0.

    Args:
        config: the engine arguments (block size, memory utilization, pool size overrides).
        spec: model, hardware, tensor-parallel size, dtypes, cost-model parameters.
        clock: the simulated clock the engine reads.

    Raises:
        ValueError: the model does not split over the tensor-parallel size.
    """

    tokenizer = None
    load_time_s = 0.0
    eos_token_id = SIM_EOS
    device = torch.device("cpu")

    def __init__(self, config: EngineConfig, spec: SimSpec, clock: SimClock) -> None:
        arch, tp = spec.arch, spec.tensor_parallel_size
        self.config, self.spec, self.clock = config, spec, clock
        self.cost = CostModel(arch, spec.hardware, tp, spec.dtype, spec.kv_cache_dtype, spec.efficiency)
        self.block_size = config.block_size
        self.hf_config = arch
        self.model_folder = arch.source or arch.name
        self.model_name = f"{arch.name}'s"
        self.max_position_embeddings = arch.max_position_embeddings
        #: request id -> the output length at which that request samples end-of-sequence
        self.stop_at: dict[str, int] = {}
        #: the last step's ``(StepCost, sequences scheduled)``
        self.last_cost: tuple[StepCost, int] | None = None

    def load_model(self, max_model_len: int) -> None:
        """Nothing to load: the cost model is the model."""

    def memory_budget(self, max_model_len: int, max_num_batched_tokens: int) -> MemoryBudget:
        """:func:`workbench.memory.plan_memory` on the simulated device: its capacity, the weights
        per rank, the activation reserve and the NCCL buffers of the group."""
        config, spec = self.config, self.spec
        arch, tp = spec.arch, spec.tensor_parallel_size
        kv_name = spec.dtype if spec.kv_cache_dtype == "auto" else spec.kv_cache_dtype
        activation = spec.activation_bytes
        if activation is None:
            w_dtype = _TORCH_DTYPES[spec.dtype]
            activation = activation_peak_bytes(arch, max_num_batched_tokens, config.max_num_seqs, w_dtype)
        mb = plan_memory(
            hf_config=arch,
            device=torch.device("cpu"),  # capacity = device_memory: the simulated device's
            device_memory=spec.hardware.memory_bytes,
            gpu_memory_utilization=config.gpu_memory_utilization,
            weights_bytes=arch.num_params(tp) * DTYPE_BYTES[spec.dtype],
            kv_dtype=_TORCH_DTYPES[kv_name],
            block_size=config.block_size,
            max_model_len=max_model_len,
            activation_bytes=activation,
            comm_buffer_bytes=comm_buffer_bytes(tp, spec.nccl_nchannels, config) + self._custom_ar_bytes(),
            num_gpu_blocks_override=config.num_gpu_blocks_override,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            tensor_parallel_size=tp,
        )
        return replace(
            mb,
            source="simulated" if mb.source == "cpu device_memory" else mb.source,
            device_name=f"{tp} x {spec.hardware.name}" if tp > 1 else spec.hardware.name,
        )

    def _custom_ar_bytes(self) -> int:
        """One rank's custom all-reduce buffers (0 unless ``SimSpec.custom_all_reduce``)."""
        if not self.spec.custom_all_reduce:
            return 0
        from workbench.comm import custom_all_reduce_bytes

        nvlink = self.spec.hardware.interconnect == "NVLink"
        return custom_all_reduce_bytes(self.spec.tensor_parallel_size, fully_connected=nvlink).per_rank_bytes

    def check_fits(self, memory: MemoryBudget, num_cpu_blocks: int) -> None:
        """The simulated device holds its own budget: nothing is allocated here."""

    def init_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """No tensors: the KV manager's block tables are the whole cache."""

    def shutdown(self) -> None:
        """No processes to stop."""

    def execute_step(self, out: SchedulerOutput, kv=None) -> ModelRunnerOutput:
        """Price the step, advance the clock by its duration, and draw its tokens.

        Each scheduled sequence of ``n`` tokens after ``start`` computed ones is a prefill chunk
        ``(start, n)`` when ``n > 1`` and a decode of context ``start + 1`` otherwise.
        """
        decode_ctx = 0
        pairs = 0
        kv_read = 0
        sampled = {}
        stop_at = self.stop_at
        for s in out.scheduled:
            n = s.num_new_tokens
            st = s.start
            if s.samples:
                r = s.request
                rid = r.request_id
                sampled[rid] = SIM_EOS if stop_at.get(rid) == len(r.output_token_ids) + 1 else 0
            if n == 1:
                decode_ctx += st + 1
            else:
                pairs += n * st + n * (n + 1) // 2
                kv_read += st + n
        sampling = len(sampled)  # one entry per sampling request
        cost = self.cost.step_from_sums(
            num_tokens=out.num_prefill_tokens + out.num_decode_tokens,
            num_seqs=len(out.scheduled),
            num_sampling=sampling,
            pairs=pairs + decode_ctx,
            kv_read_tokens=kv_read + decode_ctx,
            swap_blocks=len(out.swap_out) + len(out.swap_in),
            copied_blocks=len(out.block_copies),
            block_bytes=self.cost.kv_bytes_per_token * self.block_size,
        )
        self.clock.advance(cost.time_s)
        self.last_cost = (cost, len(out.scheduled))
        comm = None
        if cost.comm_s > 0:
            comm = _SimComm(*self.cost.comm_bytes(out.total_tokens, sampling), cost.comm_s)
        over = cost.overhead_s
        return ModelRunnerOutput(sampled, cost.time_s - over, 0.0, over, comm, copy_time_s=cost.swap_s)

    def copy_blocks(self, swap_out, copies, swap_in) -> float:
        """Block copies between steps (``LLMEngine.compact``): priced by the cost model, the clock advanced by
        them; returns their seconds."""
        s = self.cost.copy_s(len(swap_out) + len(swap_in), len(copies), self.cost.kv_bytes_per_token * self.block_size)
        self.clock.advance(s)
        return s

    def shape(self, out: SchedulerOutput) -> StepShape:
        """The step as a :class:`StepShape` (for inspection and tests)."""
        sh = StepShape(block_size=self.block_size)
        for s in out.scheduled:
            if s.num_new_tokens == 1:
                sh.decode.append(s.start + 1)
            else:
                sh.prefill.append((s.start, s.num_new_tokens))
            sh.num_sampling += s.samples
        sh.swap_blocks = len(out.swap_out) + len(out.swap_in)
        sh.copied_blocks = len(out.block_copies)
        return sh


class SimEngine(LLMEngine):
    """:class:`LLMEngine` with a :class:`SimulatedExecutor` and a :class:`SimClock`, fed by traces.

    Args:
        config: engine arguments (``block_size``, ``gpu_memory_utilization``, ``max_num_seqs``,
            ``max_num_batched_tokens``, ``max_model_len``, preemption, prefix caching, allocator,
            ...); ``model``, ``device``, ``dtype`` and ``attention_backend`` are not used (the
            ``spec`` names model, device and dtype).
        spec: model, hardware, tensor-parallel size, dtypes, cost-model parameters.
        recorder: where StepStats and request records go.

    Raises:
        ValueError: bad engine arguments, a model that does not split over the tensor-parallel
            size, or a memory budget that leaves no room for one ``max_model_len`` sequence
            (the message names the figures and the fix).
    """

    def __init__(self, config: EngineConfig, spec: SimSpec, recorder: Recorder | None = None) -> None:
        self.spec = spec
        clock = SimClock()
        super().__init__(config, recorder, executor=SimulatedExecutor(config, spec, clock), clock=clock)
        self.cost_model = self.executor.cost
        self.comm_buffer_bytes = self.memory.comm_buffer_bytes
        self._pending: deque[tuple[str, TraceRequest]] = deque()
        self._num_traced = 0
        self._max_tokens: int | None = None
        #: keep every inter-token gap in the request records (False: ``itl_s`` stays empty)
        self.record_itl = True
        self._step_costs: list | None = None

    @property
    def now(self) -> float:
        """The simulated clock (seconds)."""
        return self.clock.now

    @property
    def step_costs(self) -> list | None:
        """When set to a list, ``(StepCost, sequences scheduled)`` of every recorded step is appended (calibration)."""
        return self._step_costs

    @step_costs.setter
    def step_costs(self, costs: list | None) -> None:
        self._step_costs = costs
        if costs is not None:
            self.recorder.add_sink(CallbackSink(lambda _st: costs.append(self.executor.last_cost)))

    # ------------------------------------------------------------------ requests
    def add_trace(self, trace: list[TraceRequest], max_tokens: int | None = None) -> None:
        """Queue a trace's requests; each enters the engine when the clock reaches its arrival.

        Args:
            trace: requests in arrival order (a later call appends; arrivals must not go back in time).
            max_tokens: output cap of requests that end with EOS (``None`` = ``max_model_len``).

        Raises:
            ValueError: arrivals out of order.
        """
        last = self._pending[-1][1].arrival_s if self._pending else -1.0
        for i, tr in enumerate(trace):
            if tr.arrival_s < last:
                raise ValueError(
                    f"trace request {i} arrives at {tr.arrival_s} s, before the previous one ({last} s); "
                    "sort the trace by arrival time"
                )
            last = tr.arrival_s
            self._pending.append((f"sim-{self._num_traced}", tr))
            self._num_traced += 1
        self._max_tokens = max_tokens

    def _admit_arrivals(self) -> None:
        while self._pending and self._pending[0][1].arrival_s <= self.clock.now:
            rid, tr = self._pending.popleft()
            self.add_request_lengths(
                rid, tr.prompt_len, tr.output_len, tr.eos, tr.arrival_s, tr.prefix_id, tr.prefix_len
            )

    def add_request_lengths(
        self,
        request_id: str,
        prompt_len: int,
        output_len: int,
        eos: bool = True,
        arrival_time: float = 0.0,
        prefix_id: int | None = None,
        prefix_len: int = 0,
    ) -> str:
        """Queue one request by its lengths (tokens), arriving at ``arrival_time`` (simulated s).

        ``eos=True``: it samples the end-of-sequence token as its ``output_len``-th token
        (``max_tokens`` = the ``add_trace`` cap, or ``max_model_len``); ``eos=False``: it runs to
        ``max_tokens = output_len``. Either way ``output_len`` is the request's ``true_output_len``
        (what the contiguous baselines reserve by; it ends the request there, as the sampled EOS or the
        cap does). Prompt token ids are distinct per request (no prefix is shared).
        """
        if eos:
            cap = self._max_tokens or self.max_model_len
            sp = SamplingParams(max_tokens=max(cap, output_len))
            self.executor.stop_at[request_id] = output_len
        else:
            sp = SamplingParams(max_tokens=output_len, ignore_eos=True)
        own = [2 + (self._counter % 1_000_000_007)]
        shared = min(prefix_len, prompt_len) if prefix_id is not None else 0
        if shared > 0:
            ids = [PREFIX_TOKEN_BASE + prefix_id] + [0] * (shared - 1)
            ids += (own + [0] * (prompt_len - shared - 1)) if prompt_len > shared else []
        else:
            ids = own + [0] * (prompt_len - 1)
        return self.add_request(
            request_id, None, sp, arrival_time=arrival_time, tokenized=(ids, None), true_output_len=output_len
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or super().has_unfinished_requests()

    # ------------------------------------------------------------------ step
    def step(self) -> list:
        """Admit the arrivals the clock has reached (jumping ahead to the next one when idle),
        then one engine step. Returns the requests' outputs finished in it (no text is decoded)."""
        self._admit_arrivals()
        if not super().has_unfinished_requests():
            if not self._pending:
                return []
            self.clock.jump_to(self._pending[0][1].arrival_s)
            self._admit_arrivals()
        self.scheduler.record_token_times = self.record_itl
        outputs = super().step()
        for o in outputs:
            self.executor.stop_at.pop(o.request_id, None)
        return outputs

    def run(self, progress=None) -> None:
        """Step until every queued and pending request has finished.

        Args:
            progress: a callable ``(engine) -> None`` called after each step (e.g. a progress bar).
        """
        # The replay allocates many short-lived objects that form no reference cycles (step
        # schedules, step records); the cyclic collector's passes over the growing heap would cost
        # time and free nothing, so it is off while it runs (see docs/benchmarks.md, section
        # "Replay speed").
        enabled = gc.isenabled()
        gc.disable()
        try:
            while self.has_unfinished_requests():
                self.step()
                if progress is not None:
                    progress(self)
        finally:
            if enabled:
                gc.enable()

"""One record per engine step (docs/architecture.md §4) and one per finished request.

Latency definitions follow vLLM's benchmarks (benchmarks/benchmark_serving.py):
TTFT = first token time - arrival; TPOT = (e2e - TTFT) / (output tokens - 1);
ITL = the gaps between consecutive output tokens; e2e = finish - arrival.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass, field, fields

from workbench.request import Request


def record_dict(record) -> dict:
    """A record dataclass as a dict of its fields, in order, its lists copied: what ``dataclasses.asdict`` gives for
    records whose values are scalars and lists of scalars, without its deep copy of every value (a long run writes
    hundreds of thousands of records)."""
    return {n: list(v) if isinstance(v := getattr(record, n), list) else v for n in _field_names(type(record))}


@functools.cache
def _field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


@dataclass
class StepStats:
    """What one engine step did and where the KV pool stood after it.

    Times in seconds (``time_s`` since the engine started; ``model_time_s`` covers input
    preparation and the forward; recording happens after ``wall_time_s`` is taken); memory figures in token
    slots (multiply by ``kv_bytes_per_token`` for bytes); see docs/architecture.md §3.
    ``token_states + reservation + internal_fragmentation + external_fragmentation + free
    == num_blocks * block_size``.
    """

    step: int
    time_s: float
    wall_time_s: float
    schedule_time_s: float
    model_time_s: float
    sample_time_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_prefill_reqs: int
    num_decode_reqs: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_finished: int
    num_blocks: int
    blocks_used: int
    blocks_free: int
    block_size: int
    kv_bytes_per_token: int
    token_states: int
    reservation: int
    internal_fragmentation: int
    external_fragmentation: int
    free: int
    kv_utilization: float
    fragmentation_rate: float
    num_preempted_recompute: int = 0  # of num_preemptions, by kind
    num_preempted_swap: int = 0
    num_swapped: int = 0  # requests whose blocks sit in the CPU swap pool after the step
    swap_out_blocks: int = 0  # blocks copied device -> CPU this step
    swap_in_blocks: int = 0  # blocks copied CPU -> device this step
    cow_block_copies: int = 0  # copy-on-write block copies this step
    num_cached_free_blocks: int = 0  # free blocks still holding a prefix-cached block
    prefix_cache_queries: int = 0  # prompt tokens looked up this step (first admissions only)
    prefix_cache_hits: int = 0  # of those, tokens served from the cache
    #: prefix-cached free blocks evicted (handed out for new content) this step, and the age of each: engine
    #: steps from the step its last owner freed it to this one (0 = freed and evicted in the same step); the
    #: policy is ``prefix_cache_eviction`` (workbench.kv.eviction)
    prefix_cache_evictions: int = 0
    evicted_block_ages_steps: list[int] = field(default_factory=list)
    # tensor parallelism (rank 0's collectives this step; workbench.comm.CommStats): payload bytes
    # per rank, seconds in collectives (waiting for the slowest rank included); 0 on one device
    allreduce_bytes: int = 0
    allgather_bytes: int = 0
    broadcast_bytes: int = 0  # the step's inputs sent to the other ranks
    num_collectives: int = 0
    comm_time_s: float = 0.0  # part of model_time_s
    # KV compaction (workbench.kv.defrag): passes run for this step (by trigger after scheduling, or
    # between steps by LLMEngine.compact), blocks and bytes they moved, waiting requests admitted this step that no
    # free run held at the previous pass; seconds of all the step's block copies (swap, copy-on-write, moves;
    # part of model_time_s) plus those of passes run between steps
    defrag_passes: int = 0
    defrag_blocks_moved: int = 0
    defrag_bytes_moved: int = 0
    defrag_unblocked: int = 0
    copy_time_s: float = 0.0

    def to_dict(self) -> dict:
        return record_dict(self)


def step_stats(step: int, times: tuple, out, scheduler, kv, kv_bytes_per_token: int, usage, num_finished: int, result):
    """The record of one engine step: what it ran (``out``, a ``SchedulerOutput``), where the queues
    (``scheduler``) and the KV pool (``kv``, and ``usage``: the split of
    :mod:`workbench.metrics.accounting`) stood after it.

    Args:
        times: ``(time_s, wall_time_s, schedule_time_s, model_time_s, sample_time_s)`` in seconds.
        result: the executor's ``ModelRunnerOutput`` (its ``comm``: the step's collectives, anything with
            ``to_dict()``, or ``None``; its ``copy_time_s``).
    """
    n_prefill = out.num_prefill_reqs
    policy = getattr(getattr(kv, "pool", None), "policy", None)  # the paged manager's eviction policy
    ages = policy.take_evicted_ages(step + 1) if policy is not None else []
    comm = getattr(result, "comm", None)
    d = out.defrag
    free_blocks = kv.num_free_blocks
    return StepStats(
        *(step, *times),
        num_prefill_tokens=out.num_prefill_tokens,
        num_decode_tokens=out.num_decode_tokens,
        num_prefill_reqs=n_prefill,
        num_decode_reqs=len(out.scheduled) - n_prefill,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_preemptions=len(out.preempted),
        num_preempted_recompute=out.num_preempted_recompute,
        num_preempted_swap=out.num_preempted_swap,
        num_swapped=len(scheduler.swapped),
        swap_out_blocks=len(out.swap_out),
        swap_in_blocks=len(out.swap_in),
        cow_block_copies=len(out.block_copies) - (d.carried if d else 0),
        num_finished=num_finished,
        num_blocks=kv.num_blocks,
        blocks_used=kv.num_blocks - free_blocks,
        blocks_free=free_blocks,
        block_size=kv.block_size,
        kv_bytes_per_token=kv_bytes_per_token,
        token_states=usage.token_states,
        reservation=usage.reservation,
        internal_fragmentation=usage.internal_fragmentation,
        external_fragmentation=usage.external_fragmentation,
        free=usage.free,
        kv_utilization=usage.kv_utilization,
        fragmentation_rate=usage.fragmentation_rate,
        num_cached_free_blocks=len(kv.cached_free_blocks()) if kv.enable_prefix_caching else 0,
        prefix_cache_queries=out.prefix_cache_queries,
        prefix_cache_hits=out.prefix_cache_hits,
        prefix_cache_evictions=len(ages),
        evicted_block_ages_steps=ages,
        defrag_passes=d.passes if d else 0,
        defrag_blocks_moved=d.blocks_moved if d else 0,
        defrag_bytes_moved=d.bytes_moved if d else 0,
        defrag_unblocked=d.unblocked if d else 0,
        copy_time_s=getattr(result, "copy_time_s", 0.0) + (d.copy_time_s if d else 0.0),
        **(comm.to_dict() if comm is not None else {}),
    )


def prefix_cache_summary(steps: list[dict]) -> dict[str, float | int | None]:
    """A run's prefix-cache figures from its step records (``StepStats.to_dict()`` s): ``prefix_cache_queries_total``
    and ``prefix_cache_hits_total`` (prompt tokens looked up / served from the cache, first admissions),
    ``prefix_cache_hit_rate_frac`` (hits / queries, 0..1; ``None`` without queries),
    ``prefix_cache_evictions_total`` (blocks), ``evicted_block_age_mean_steps`` and ``evicted_block_age_p50_steps``
    (engine steps from a block's free to its eviction; median by ``statistics.median``; ``None`` without evictions).
    """
    queries = sum(s.get("prefix_cache_queries", 0) for s in steps)
    hits = sum(s.get("prefix_cache_hits", 0) for s in steps)
    ages = [a for s in steps for a in s.get("evicted_block_ages_steps") or ()]
    return {
        "prefix_cache_queries_total": queries,
        "prefix_cache_hits_total": hits,
        "prefix_cache_hit_rate_frac": hits / queries if queries else None,
        "prefix_cache_evictions_total": sum(s.get("prefix_cache_evictions", 0) for s in steps),
        "evicted_block_age_mean_steps": statistics.fmean(ages) if ages else None,
        "evicted_block_age_p50_steps": statistics.median(ages) if ages else None,
    }


@dataclass
class RequestRecord:
    """Latency and size of one request. Times in seconds since the engine started."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    error: str | None
    arrival_time_s: float | None
    first_scheduled_time_s: float | None
    first_token_time_s: float | None
    finish_time_s: float | None
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    queue_time_s: float | None
    itl_s: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    num_prefill_chunks: int = 0
    num_cached_tokens: int = 0
    #: the output cap it ran with (tokens: ``max_tokens``, after any cap its KV reservation set)
    max_tokens: int | None = None
    #: a replayed trace's true output length (tokens; the request ended there as at EOS), ``None`` when not given
    true_output_len: int | None = None

    def to_dict(self) -> dict:
        return record_dict(self)


def request_record(req: Request, t0: float) -> RequestRecord:
    """Build the record of a finished request; ``t0`` is the engine's start (perf_counter seconds)."""

    def rel(t: float | None) -> float | None:
        return None if t is None else t - t0

    ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
    e2e = None if req.finish_time is None else req.finish_time - req.arrival_time
    n = req.num_output_tokens
    tpot = (e2e - ttft) / (n - 1) if (ttft is not None and e2e is not None and n > 1) else None
    times = req.token_times
    return RequestRecord(
        request_id=req.request_id,
        prompt_tokens=req.num_prompt_tokens,
        output_tokens=n,
        finish_reason=req.status.value,
        error=req.error,
        arrival_time_s=rel(req.arrival_time),
        first_scheduled_time_s=rel(req.first_scheduled_time),
        first_token_time_s=rel(req.first_token_time),
        finish_time_s=rel(req.finish_time),
        ttft_s=ttft,
        tpot_s=tpot,
        e2e_s=e2e,
        queue_time_s=None if req.first_scheduled_time is None else req.first_scheduled_time - req.arrival_time,
        itl_s=[b - a for a, b in zip(times, times[1:])],
        num_preemptions=req.num_preemptions,
        num_prefill_chunks=req.num_prefill_chunks,
        num_cached_tokens=req.num_cached_tokens,
        max_tokens=req.sampling_params.max_tokens,
        true_output_len=req.true_output_len,
    )

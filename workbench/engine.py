"""``LLMEngine`` (add_request / step / abort) and ``LLM.generate``, in vLLM's shape.

from workbench import LLM, SamplingParams
llm = LLM(block_size=16, max_num_seqs=32)          # the bundled SmolLM2-135M
out = llm.generate(["Hello"], SamplingParams(max_tokens=32))
print(out[0].outputs[0].text)
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from workbench.config import EngineConfig, GiB
from workbench.executor.local import LocalExecutor, prepare_inputs
from workbench.kv.contiguous import ContiguousKVCacheManager, reservation_tokens
from workbench.kv.manager import KVCacheManager
from workbench.memory import MemoryBudget, plan_memory, profile_activation_peak
from workbench.metrics import Recorder, StepStats, request_record
from workbench.model.llama import LlamaForCausalLM
from workbench.model.loader import load_model
from workbench.request import Request, RequestStatus
from workbench.sampling import SamplingParams, sample
from workbench.scheduler import Scheduler

log = logging.getLogger("workbench")

#: A prompt: text (no template), token ids, or chat messages ``[{"role", "content"}]``
#: (the model's chat template is applied).
Prompt = str | list[int] | list[dict]


@dataclass
class CompletionOutput:
    """One generated sequence: ``text`` (decoded when the request finishes) and ``token_ids``."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    """A request's result, as vLLM's ``RequestOutput``.

    ``error`` is set (and ``outputs[0].finish_reason == "error"``) when the engine refused
    the request, e.g. a prompt longer than ``max_model_len``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    metrics: dict = field(default_factory=dict)


def resolve_lengths(config: EngineConfig, model_max: int, whose: str) -> tuple[int, int]:
    """``(max_model_len, max_num_batched_tokens)`` in tokens, with vLLM's defaults: the model's
    ``max_position_embeddings`` (at most ``DEFAULT_MAX_MODEL_LEN``), and a token budget of
    ``max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs)`` with chunked prefill, else
    ``max(max_model_len, max_num_seqs)``.

    Raises:
        ValueError: ``max_model_len`` beyond ``model_max`` (``whose`` names the model in the message).
    """
    if config.max_model_len is None:
        max_model_len = min(model_max, EngineConfig.DEFAULT_MAX_MODEL_LEN)
    elif config.max_model_len > model_max:
        raise ValueError(
            f"max_model_len={config.max_model_len} exceeds {whose} max_position_embeddings={model_max}; "
            f"use max_model_len <= {model_max}"
        )
    else:
        max_model_len = config.max_model_len
    if config.max_num_batched_tokens is not None:
        budget = config.max_num_batched_tokens
    elif config.enable_chunked_prefill:
        budget = max(EngineConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS, config.max_num_seqs)
    else:
        budget = max(max_model_len, config.max_num_seqs)
    return max_model_len, budget


class LLMEngine:
    """The serving engine: a scheduler, a KV-cache manager and a model executor.

    Args:
        config: the engine arguments (validated here, before the model loads).
        recorder: where StepStats and request records go (a new in-memory one by default).

    Raises:
        ValueError / FileNotFoundError: a bad argument (see :meth:`EngineConfig.validate`),
            or a KV pool that cannot hold one ``max_model_len`` sequence.
    """

    #: largest pool (blocks) for which ``block_map_every`` may record per-block pictures
    MAX_BLOCK_MAP_BLOCKS = 65_536

    def __init__(self, config: EngineConfig, recorder: Recorder | None = None) -> None:
        self.config = config.validate()
        self.recorder = recorder or Recorder()
        torch.manual_seed(config.seed)
        self.device = config.torch_device
        if config.uses_workers:
            from workbench.executor.tensor_parallel import check_not_bootstrapping

            check_not_bootstrapping()  # before the weights: a worker re-running an unguarded script
        t0 = time.perf_counter()
        loaded = load_model(config.model, config.resolved_cache_dir, config.tokenizer)
        self.hf_config = loaded.hf_config
        self.tokenizer = loaded.tokenizer
        self.model_folder = loaded.folder
        cfg = self.hf_config

        model_max = getattr(cfg, "max_position_embeddings", None) or EngineConfig.DEFAULT_MAX_MODEL_LEN
        self.max_model_len, self.max_num_batched_tokens = resolve_lengths(config, model_max, "the model's")

        #: tensor parallelism: worker processes, each with a shard (workbench.executor.tensor_parallel)
        self._tp = None
        if config.uses_workers:
            from workbench.executor.tensor_parallel import TensorParallelExecutor

            self._tp = TensorParallelExecutor(config, cfg, loaded.state_dict, self.max_model_len)
            self.model = self._tp.model  # rank 0's shard
            del loaded
        else:
            with torch.device("meta"):
                model = LlamaForCausalLM(cfg, self.max_model_len)
            model = model.to_empty(device="cpu")
            model.rotary = type(model.rotary)(cfg, self.max_model_len)  # buffers are not in the checkpoint
            model.load_hf_state_dict(loaded.state_dict)
            del loaded
            self.model = model.to(device=self.device, dtype=config.torch_dtype).eval()
            self.model.rotary.float()  # keep RoPE tables in float32, as transformers does
        self.load_time_s = time.perf_counter() - t0

        if config.device_memory is None and self.device.type == "cpu":
            device_memory = EngineConfig.DEFAULT_CPU_DEVICE_MEMORY
        else:
            device_memory = config.device_memory
        activation = 0
        if config.num_gpu_blocks_override is None and config.kv_cache_memory_bytes is None:
            # vLLM's profile run: the peak of one forward at the step's token budget
            if self._tp is not None:  # every rank profiles its shard (collectives included); the largest peak
                activation = self._tp.profile_activation_peak(
                    self.max_num_batched_tokens, self.max_model_len, config.max_num_seqs, config.block_size
                )
            else:
                activation = profile_activation_peak(
                    self.model,
                    self.max_num_batched_tokens,
                    self.max_model_len,
                    config.max_num_seqs,
                    config.block_size,
                    key=(str(self.model_folder), str(config.torch_dtype), str(self.device)),
                )
        self.memory: MemoryBudget = plan_memory(
            hf_config=cfg,
            device=self.device,
            device_memory=device_memory,
            gpu_memory_utilization=config.gpu_memory_utilization,
            weights_bytes=self.model.weight_bytes(),
            kv_dtype=config.kv_torch_dtype,
            block_size=config.block_size,
            max_model_len=self.max_model_len,
            activation_bytes=activation,
            num_gpu_blocks_override=config.num_gpu_blocks_override,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            tensor_parallel_size=config.tensor_parallel_size,
            comm_buffer_bytes=self._tp.comm_buffer_bytes if self._tp is not None else 0,
        )
        log.info(self.memory.summary_line())
        if config.block_map_every and self.memory.num_blocks > self.MAX_BLOCK_MAP_BLOCKS:
            raise ValueError(
                f"block_map_every={config.block_map_every} records a picture of every block, but the pool has "
                f"{self.memory.num_blocks:,} blocks (more than {self.MAX_BLOCK_MAP_BLOCKS:,}); size the pool with "
                "num_gpu_blocks_override or kv_cache_memory_bytes, raise block_size, or set block_map_every=0"
            )
        num_cpu_blocks = 0
        if config.preemption_mode == "swap":
            num_cpu_blocks = int(config.swap_space * GiB) // self.memory.block_bytes
            if num_cpu_blocks < 1:
                raise ValueError(
                    f"swap_space={config.swap_space} GiB holds no KV block of {self.memory.block_bytes:,} B; "
                    "raise swap_space or use preemption_mode='recompute'"
                )
        self._check_fits(num_cpu_blocks)
        self._make_kv_and_scheduler(num_cpu_blocks)
        if self._tp is not None:
            self._tp.init_cache(
                self.memory.num_blocks,
                config.block_size,
                config.kv_torch_dtype,
                num_cpu_blocks,
                config.attention_backend,
            )
            self.executor = self._tp
        else:
            self.executor = LocalExecutor(
                self.model,
                self.memory.num_blocks,
                config.block_size,
                config.kv_torch_dtype,
                self.device,
                num_cpu_blocks=num_cpu_blocks,
                attention_backend=config.attention_backend,
            )
        self.requests: dict[str, Request] = {}  # every unfinished sequence, by its own id
        self.groups: dict[str, list[Request]] = {}  # the user's request id -> its n sequences
        self._generators: dict[str, torch.Generator | None] = {}
        self._refused: list[Request] = []
        self._counter = 0
        self._step = 0
        #: per request holding blocks: (request, most KV slots it may write, [(step stats, slots held,
        #: slots written)]) — to settle reservation vs internal fragmentation when it releases them
        #: request id -> (request, most slots it can write, [([StepStats], slots held, slots written)])
        #: of the steps of its current holding of blocks that _settle may still correct
        self._holding: dict[str, tuple[Request, int, list]] = {}
        self.start_time = time.perf_counter()
        self.eos_token_id = self._eos_id()
        #: seconds to build the engine: model load, workers, the profile run, the KV cache
        self.startup_time_s = self.start_time - t0

    def _make_kv_and_scheduler(self, num_cpu_blocks: int, clock=time.perf_counter) -> None:
        """The KV-cache manager of ``kv_allocator`` over the planned pool, and the scheduler over it
        (``clock``: the scheduler's time source; the simulator passes its simulated clock)."""
        config = self.config
        if config.kv_allocator == "paged":
            self.kv = KVCacheManager(
                self.memory.num_blocks, config.block_size, config.enable_prefix_caching, num_cpu_blocks
            )
        else:
            self.kv = ContiguousKVCacheManager(self.memory.num_blocks, config.block_size, config.kv_allocator)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            scheduling_policy=config.scheduling_policy,
            preemption_mode=config.preemption_mode,
            batching_policy=config.batching_policy,
            clock=clock,
        )

    def _check_fits(self, num_cpu_blocks: int) -> None:
        """Refuse a KV pool the machine cannot hold, before allocating it.

        CPU: the pool, the swap pool and the weights against the machine's physical memory (a
        ``device_memory`` or ``num_gpu_blocks_override`` larger than the RAM would otherwise end in
        an allocation failure or the OOM killer). CUDA: the pool against the device's free memory.

        Raises:
            ValueError: naming the sizes and the fix.
        """
        m = self.memory
        gib = 1 << 30
        swap = num_cpu_blocks * m.block_bytes
        if self.device.type == "cpu":
            try:
                ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (ValueError, OSError, AttributeError):
                return
            need = m.kv_pool_bytes + swap + m.weights_bytes
            if need > ram:
                raise ValueError(
                    f"the KV pool ({m.kv_pool_bytes / gib:,.2f} GiB = {m.num_blocks:,} blocks) + swap space "
                    f"({swap / gib:,.2f} GiB) + weights ({m.weights_bytes / gib:,.2f} GiB) need {need / gib:,.2f} GiB "
                    f"but this machine has {ram / gib:,.2f} GiB of RAM; lower device_memory, "
                    "num_gpu_blocks_override or kv_cache_memory_bytes (or swap_space)"
                )
        elif self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            if m.kv_pool_bytes > free:
                raise ValueError(
                    f"the KV pool ({m.kv_pool_bytes / gib:,.2f} GiB = {m.num_blocks:,} blocks) exceeds the device's "
                    f"free memory ({free / gib:,.2f} GiB); lower gpu_memory_utilization, num_gpu_blocks_override "
                    "or kv_cache_memory_bytes"
                )

    # ------------------------------------------------------------------ requests
    def _eos_id(self) -> int | None:
        eos = getattr(self.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = self.tokenizer.eos_token_id
        return eos

    def tokenize(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """Token ids (and text) of a prompt; chat messages get the model's chat template.

        Raises:
            ValueError: an empty prompt, or text with no tokenizer available.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty; give at least one character or token id")
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: pass prompts as token-id lists")
            return self.tokenizer.encode(prompt, add_special_tokens=True), prompt
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
                raise ValueError("chat messages need a tokenizer with a chat template; pass a plain string")
            text = self.tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False), text
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty; give at least one character or token id")
        vocab = self.hf_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab}); fix the prompt's token ids")
        return ids, None

    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        tokenized: tuple[list[int], str | None] | None = None,
        priority: int = 0,
        expected_output_len: int | None = None,
    ) -> str:
        """Queue a request; return its id.

        ``tokenized`` = the ``(token_ids, text)`` of :meth:`tokenize` when the caller already has them.
        ``priority``: lower values are served first under ``scheduling_policy="priority"``.
        ``expected_output_len``: the request's true output length (tokens), from a previous run or
        the trace; ``kv_allocator="orca-oracle"`` / ``"orca-pow2"`` reserve by it and cap
        ``max_tokens`` at it (so the reservation always holds the output).
        With ``sampling_params.n > 1`` the request runs as n sequences that share the prompt's
        blocks; its output (one ``RequestOutput`` with n ``outputs``) comes when all n finish.

        A prompt that can never run (longer than ``max_model_len`` allows, or than the KV pool
        holds) does not raise: the request ends at the next step with ``finish_reason="error"``
        and an error naming both numbers, and the other requests go on.

        Raises:
            ValueError: an empty prompt, an out-of-vocabulary token id, or a duplicate request id.
        """
        sp = sampling_params or SamplingParams()
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(
                f"priority={priority} is given but scheduling_policy={self.config.scheduling_policy!r} ignores it; "
                "create the engine with scheduling_policy='priority'"
            )
        ids, text = tokenized if tokenized is not None else self.tokenize(prompt)
        allocator = self.config.kv_allocator
        if allocator != "paged":
            if sp.n > 1:
                raise ValueError(
                    f"n={sp.n} (parallel sampling) shares prompt blocks, which kv_allocator={allocator!r} cannot; "
                    "use n=1 or kv_allocator='paged'"
                )
            reserve = reservation_tokens(allocator, len(ids), sp.max_tokens, self.max_model_len, expected_output_len)
            if allocator in ("orca-oracle", "orca-pow2"):
                sp = replace(sp, max_tokens=max(1, min(sp.max_tokens, expected_output_len)))
        if request_id is None:
            request_id = str(self._counter)
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in the engine; use a unique id")
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        seed = sp.seed if sp.seed is not None else self.config.seed * 1_000_003 + self._counter
        self._counter += 1
        group = []
        for i in range(sp.n):
            child = Request(
                request_id=request_id if sp.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=ids,
                sampling_params=sp,
                arrival_time=arrival,
                prompt=text,
                eos_token_id=self.eos_token_id,
                max_total_len=self.max_model_len,
                priority=priority,
                parent_id=request_id,
                index=i,
            )
            group.append(child)
            self.requests[child.request_id] = child
            if not sp.greedy:
                g = torch.Generator(device="cpu")
                g.manual_seed(seed + i)
                self._generators[child.request_id] = g
        self.groups[request_id] = group
        req = group[0]
        n = len(ids)
        if n >= self.max_model_len:
            req.error = (
                f"prompt has {n} tokens but max_model_len={self.max_model_len} leaves room for at most "
                f"{self.max_model_len - 1} prompt tokens (one is needed for the output); shorten the prompt "
                "or raise max_model_len"
            )
        elif n + 1 > self.kv.pool_tokens:
            req.error = (
                f"prompt has {n} tokens but the KV pool holds {self.kv.pool_tokens} tokens; shorten the prompt "
                "or give the KV cache more memory"
            )
        if req.error:
            for child in group:
                child.error = req.error
                child.status = RequestStatus.FINISHED_ERROR
                child.finish_time = child.arrival_time
                self._refused.append(child)
        else:
            if allocator != "paged":
                self.kv.declare(req.request_id, reserve)
            self.scheduler.add_request(req, group[1:])
        return request_id

    def abort(self, request_id: str) -> None:
        """End a request in any state (waiting, running, swapped out), releasing everything it holds.

        No-op for an unknown or already finished request.
        """
        for req in self.groups.get(request_id, ()):
            if not req.is_finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                self._refused.append(req)  # reported at the next step

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and free the process group (no-op on one device;
        idempotent; also done at garbage collection and interpreter exit). Use the engine (or
        :class:`LLM`) as a context manager to call it on leaving the block."""
        if self._tp is not None:
            self._tp.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._refused)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one iteration: schedule, run the model, sample, update. Returns the requests finished in it.

        Raises:
            TensorParallelError: (``tensor_parallel_size > 1``) a worker died, or hung past
                ``distributed_timeout_s``; every worker has been stopped and the engine is unusable.
        """
        finished: list[Request] = self._refused
        self._refused = []
        t_start = time.perf_counter()
        out = self.scheduler.schedule()
        t_sched = time.perf_counter()
        if out.is_empty and self.scheduler.waiting and not self.scheduler.running:
            # cannot happen while the pool holds one max_model_len sequence (checked at startup);
            # fail loudly rather than spin
            raise RuntimeError(f"scheduler made no progress with {len(self.scheduler.waiting)} waiting requests")
        model_s = sample_s = 0.0
        comm0 = self._tp.stats.copy() if self._tp is not None else None
        if out.swap_out or out.block_copies or out.swap_in:
            self.executor.copy_blocks(out.swap_out, out.block_copies, out.swap_in)
        if not out.is_empty:
            inp = prepare_inputs(out, self.kv, self.device)
            logits = self.executor.execute_model(inp)
            t_model = time.perf_counter()
            reqs = [s.request for s in inp.sampling]
            toks = sample(logits, [r.sampling_params for r in reqs], [self._generators.get(r.request_id) for r in reqs])
            t_end = time.perf_counter()
            model_s, sample_s = t_model - t_sched, t_end - t_model
            finished += self.scheduler.update(out, {r.request_id: t for r, t in zip(reqs, toks)}, t_end)
        t_end = time.perf_counter()
        if not out.is_empty or finished or out.preempted:
            comm = self._tp.stats.since(comm0) if comm0 is not None else None
            self._record_step(out, finished, t_start, t_end, t_sched - t_start, model_s, sample_s, comm)
        outputs = []
        for r in finished:
            self.requests.pop(r.request_id, None)
            self._generators.pop(r.request_id, None)
            group = self.groups.get(r.parent_id)
            if group is not None and all(c.is_finished for c in group):
                del self.groups[r.parent_id]
                outputs.append(self._output(group))
        return outputs

    def _record_step(self, out, finished, t_start, t_end, sched_s, model_s, sample_s, comm=None) -> None:
        running = self.scheduler.running
        kv = self.kv
        bs = kv.block_size
        holding = self._holding
        requests = self.requests
        # paged without prefix caching: the §3 split's two sums are taken in this walk over the
        # block tables (KVCacheManager.usage_from_sums), not in a second one (KVCacheManager.usage)
        paged = isinstance(kv, KVCacheManager) and not kv.enable_prefix_caching
        every = self.config.block_map_every
        block_map = bool(every) and self._step % every == 0
        keep_computed = block_map or not paged  # the per-request dict only where it is read
        token_states = unwritten = 0
        computed: dict[str, int] = {}
        bound: dict[str, int] = {}
        step_cell: list = [None]  # this step's StepStats, once built: entries refer to it
        num_holding = 0
        for rid, table in kv.block_tables.items():
            entry = holding.get(rid)
            if entry is None:
                r = requests.get(rid)
                if r is None:
                    continue
                # most KV slots it can write: prompt + output cap, less the last sampled token (never written)
                entry = holding[rid] = (r, r.num_prompt_tokens + r.max_output_tokens - 1, [])
            c = entry[0].num_computed_tokens
            if keep_computed:
                computed[rid] = c
            held = len(table) * bs
            if paged:
                token_states += c
                left = (held if held < entry[1] else entry[1]) - c
                if left > 0:
                    unwritten += left
            else:
                bound[rid] = entry[1]
            entries = entry[2]
            # A step in which the request held no more slots than it has written since can never be
            # corrected by _settle (its final length >= written >= held there): keep only the others,
            # so a long request keeps about one block's worth of steps, not every step.
            if entries and entries[0][1] <= c:
                k = 1
                while k < len(entries) and entries[k][1] <= c:
                    k += 1
                del entries[:k]
            entries.append((step_cell, held, c))
            num_holding += 1
        waiting = self.scheduler.waiting
        need = kv.reservation_blocks(waiting[0].request_id) if waiting else 0
        usage = kv.usage_from_sums(token_states, unwritten) if paged else kv.usage(computed, bound, need)
        n_prefill = out.num_prefill_reqs
        st = StepStats(
            step=self._step,
            time_s=t_start - self.start_time,
            wall_time_s=t_end - t_start,
            schedule_time_s=sched_s,
            model_time_s=model_s,
            sample_time_s=sample_s,
            num_prefill_tokens=out.num_prefill_tokens,
            num_decode_tokens=out.num_decode_tokens,
            num_prefill_reqs=n_prefill,
            num_decode_reqs=len(out.scheduled) - n_prefill,
            num_running=len(running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=len(out.preempted),
            num_preempted_recompute=out.num_preempted_recompute,
            num_preempted_swap=out.num_preempted_swap,
            num_swapped=len(self.scheduler.swapped),
            swap_out_blocks=len(out.swap_out),
            swap_in_blocks=len(out.swap_in),
            cow_block_copies=len(out.block_copies),
            num_finished=len(finished),
            num_blocks=self.kv.num_blocks,
            blocks_used=self.kv.num_blocks - self.kv.num_free_blocks,
            blocks_free=self.kv.num_free_blocks,
            block_size=self.kv.block_size,
            kv_bytes_per_token=self.memory.kv_bytes_per_token,
            token_states=usage.token_states,
            reservation=usage.reservation,
            internal_fragmentation=usage.internal_fragmentation,
            external_fragmentation=usage.external_fragmentation,
            free=usage.free,
            kv_utilization=usage.kv_utilization,
            fragmentation_rate=usage.fragmentation_rate,
            num_cached_free_blocks=self.kv.pool.num_cached_free_blocks if self.kv.enable_prefix_caching else 0,
            prefix_cache_queries=out.prefix_cache_queries,
            prefix_cache_hits=out.prefix_cache_hits,
            **(comm.to_dict() if comm is not None else {}),
        )
        step_cell[0] = st
        self._step += 1
        if len(holding) > num_holding:  # some request released its blocks since the last step
            tables = self.kv.block_tables
            for rid in [rid for rid in holding if rid not in tables]:
                self._settle(rid)
        if block_map:
            self.recorder.record_block_map(self.kv.block_map(computed, need, st.step))
        self.recorder.record_step(st)
        for r in finished:
            self.kv.forget(r.request_id)
            self.recorder.record_request(request_record(r, self.start_time))

    def _settle(self, request_id: str) -> None:
        """A request released its blocks (finished, aborted, preempted, swapped out): now that it is
        known how many slots it wrote, move the slots it held but never wrote from *reservation*
        to *internal fragmentation* in every step it held them (ARCHITECTURE §3)."""
        req, bound, entries = self._holding.pop(request_id)
        last_written = entries[-1][2] if entries else 0
        # a recompute preemption resets num_computed_tokens: it then wrote what the last step saw
        final = req.num_computed_tokens if req.num_computed_tokens >= last_written else last_written
        for (st,), held, written in entries:
            provisional = max(0, min(held, bound) - written)
            true = max(0, min(held, final) - written)
            delta = min(provisional - true, st.reservation)
            if delta > 0:
                st.reservation -= delta
                st.internal_fragmentation += delta

    def _output(self, group: list[Request]) -> RequestOutput:
        outs = []
        for req in group:
            text = ""
            if self.tokenizer is not None and req.output_token_ids:
                text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
            outs.append(CompletionOutput(req.index, text, list(req.output_token_ids), req.status.value))
        first = group[0]
        return RequestOutput(
            request_id=first.parent_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outs,
            finished=True,
            error=first.error,
            metrics=request_record(first, self.start_time).to_dict(),
        )


class LLM:
    """Offline batch inference, as vLLM's ``LLM``.

    Args:
        model: see :class:`EngineConfig` (default: the bundled SmolLM2-135M-Instruct).
        **engine_args: any :class:`EngineConfig` field, with vLLM's names.

    Raises:
        ValueError / FileNotFoundError: a bad engine argument, before the model loads.
    """

    def __init__(self, model: str | None = None, recorder: Recorder | None = None, **engine_args) -> None:
        if model is not None:
            engine_args["model"] = model
        unknown = set(engine_args) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown engine argument(s) {sorted(unknown)}; valid ones: "
                f"{sorted(k for k in EngineConfig.__dataclass_fields__ if k != 'extra')}"
            )
        self.llm_engine = LLMEngine(EngineConfig(**engine_args), recorder=recorder)

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def shutdown(self) -> None:
        """Stop tensor-parallel workers (see :meth:`LLMEngine.shutdown`)."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable = False,
        priority: Sequence[int] | None = None,
        expected_output_lens: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched by the engine; outputs come in the prompts' order.

        Args:
            prompts: one prompt or a list (strings, token-id lists, or chat message lists).
            sampling_params: one for all, or one per prompt.
            use_tqdm: show a progress bar of finished requests (or a tqdm-like factory).
            priority: one per prompt (lower = sooner) under ``scheduling_policy="priority"``.
            expected_output_lens: one true output length (tokens) per prompt, for
                ``kv_allocator="orca-oracle"`` / ``"orca-pow2"`` (see :meth:`LLMEngine.add_request`).

        Raises:
            ValueError: an empty prompt or a mismatched number of sampling params; raised before
                any request is queued, so nothing is lost.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        sps = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(sps) != len(prompts):
            raise ValueError(f"{len(sps)} sampling params for {len(prompts)} prompts; give one, or one per prompt")
        eng = self.llm_engine
        tokenized = [eng.tokenize(p) for p in prompts]  # validate all before queueing any
        base = eng._counter
        ids = [f"gen-{base + i}" for i in range(len(prompts))]
        prios = list(priority) if priority is not None else [0] * len(prompts)
        if len(prios) != len(prompts):
            raise ValueError(f"{len(prios)} priorities for {len(prompts)} prompts; give one per prompt")
        if any(prios) and eng.config.scheduling_policy != "priority":
            raise ValueError(
                f"priority is given but scheduling_policy={eng.config.scheduling_policy!r} ignores it; "
                "create the LLM with scheduling_policy='priority'"
            )
        lens = list(expected_output_lens) if expected_output_lens is not None else [None] * len(prompts)
        if len(lens) != len(prompts):
            raise ValueError(f"{len(lens)} expected output lengths for {len(prompts)} prompts; give one per prompt")
        if eng.config.kv_allocator in ("orca-oracle", "orca-pow2") and None in lens:
            raise ValueError(
                f"kv_allocator={eng.config.kv_allocator!r} needs each prompt's true output length: pass "
                "expected_output_lens (e.g. from a kv_allocator='paged' run), or use kv_allocator='orca-max'"
            )
        for rid, p, sp, tok, pr, n in zip(ids, prompts, sps, tokenized, prios, lens):
            eng.add_request(rid, p, sp, tokenized=tok, priority=pr, expected_output_len=n)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            factory = use_tqdm if callable(use_tqdm) else tqdm
            bar = factory(total=len(prompts), desc="requests", unit="req")
        results: dict[str, RequestOutput] = {}
        last_postfix = 0.0
        while eng.has_unfinished_requests():
            finished = eng.step()
            for o in finished:
                results[o.request_id] = o
                if bar is not None:
                    bar.update(1)
            if bar is not None and eng.recorder.steps:
                s = eng.recorder.steps[-1]
                now = time.perf_counter()
                if now - last_postfix > 0.5:  # live figures while no request has finished yet
                    bar.set_postfix(
                        step=s.step,
                        running=s.num_running,
                        waiting=s.num_waiting,
                        kv=f"{s.kv_utilization:.0%}",
                        refresh=True,
                    )
                    last_postfix = now
        if bar is not None:
            if eng.recorder.steps:  # the last step's figures, not the last refresh's
                s = eng.recorder.steps[-1]
                bar.set_postfix(step=s.step, running=s.num_running, waiting=s.num_waiting, kv=f"{s.kv_utilization:.0%}")
            bar.close()
        return [results[i] for i in ids]

    def chat(self, messages, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for one conversation or a list of them (chat template applied)."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        return self.generate(list(messages), sampling_params, use_tqdm=use_tqdm)


__all__ = ["LLM", "LLMEngine", "RequestOutput", "CompletionOutput"]

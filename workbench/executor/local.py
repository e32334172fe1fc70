"""One process, one device: the executor that loads the model and runs each step's schedule.

An executor is what :class:`~workbench.engine.LLMEngine` drives each step (docs/architecture.md §5):
``execute_step(scheduler_output, kv)`` makes the step's block copies, runs the model and samples, and returns a
:class:`ModelRunnerOutput`. :class:`LocalExecutor` does this in this process;
:class:`~workbench.executor.tensor_parallel.TensorParallelExecutor` over worker processes (both share
:class:`ModelExecutor`); :class:`~workbench.sim.engine.SimulatedExecutor` with a cost model."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from workbench.attention import AttentionMetadata, DecodeGroup, get_backend
from workbench.config import EngineConfig
from workbench.kv.interface import KVManager
from workbench.kv.manager import cdiv
from workbench.kv.moves import copy_rounds
from workbench.memory import MemoryBudget, check_fits, engine_budget, profile_activation_peak
from workbench.model.llama import LlamaForCausalLM
from workbench.model.loader import build_model, load_model
from workbench.sample_ops import any_logprobs, prompt_positions, step_logprobs
from workbench.sampling import sample
from workbench.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class ModelRunnerOutput:
    """What an executor returns for one step (vLLM v1's name).

    Attributes:
        sampled: request id -> the token it sampled (requests that reached their last token).
        model_time_s, sample_time_s: seconds of input preparation, block copies and the forward; of sampling.
        copy_time_s: of ``model_time_s``, seconds of the step's block copies (swap, copy-on-write, compaction).
        overhead_s: seconds the executor attributes to the engine's own per-step work (a simulated executor's
            modelled overhead; 0 for a real one, whose engine measures it).
        comm: the step's collectives (``to_dict()`` gives StepStats' communication fields), or ``None``.
        logprobs, prompt_logprobs: request id -> raw log-probabilities of the sampled token / of the step's
            prompt tokens (:func:`workbench.sample_ops.step_logprobs`), for requests that asked.
        failed: request id -> why its row could not be sampled (:class:`~workbench.sampling.SamplingError`);
            the engine ends that request with ``finish_reason="error"`` and steps on for the others.
    """

    sampled: dict[str, int]
    model_time_s: float = 0.0
    sample_time_s: float = 0.0
    overhead_s: float = 0.0
    comm: object | None = None
    logprobs: dict | None = None
    prompt_logprobs: dict | None = None
    copy_time_s: float = 0.0
    failed: dict[str, str] = field(default_factory=dict)


@dataclass
class ModelInput:
    """Flat tensors of one step (see :class:`~workbench.attention.AttentionMetadata`).

    Attributes:
        input_ids, positions: ``[num_tokens]`` int64, each token's id and its position in its sequence.
        meta: the paged-attention layout (slot mapping, block tables, context lengths).
        logits_indices: ``[num_sampling + num_prompt_rows]`` int64, rows of the tokens that sample, then those
            of ``prompt_rows``.
        sampling: the scheduled requests that sample, in the order of ``logits_indices``.
        order: every scheduled request in the order its tokens appear in ``input_ids`` (each contributes
            ``num_new_tokens`` consecutive tokens): decodes first, then the rest.
        prompt_rows: ``(request, lo, hi)``: a ``prompt_logprobs`` request's prompt positions ``lo..hi-1`` in this step.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling: list[ScheduledRequest]
    order: list[ScheduledRequest] = field(default_factory=list)
    prompt_rows: list = field(default_factory=list)


def prepare_inputs(out: SchedulerOutput, kv: KVManager, device: torch.device) -> ModelInput:
    """Lay out a step: one-token sequences first (batched decode path), then multi-token ones."""
    # one-token sequences sorted by context length, so that length groups are contiguous
    decodes = sorted((s for s in out.scheduled if s.num_new_tokens == 1), key=lambda s: s.start)
    prefills = [s for s in out.scheduled if s.num_new_tokens > 1]
    bs = kv.block_size
    ids, pos, slots, logits_idx, prompt_idx, prompt_rows = [], [], [], [], [], []
    sampling: list[ScheduledRequest] = []
    for s in decodes + prefills:
        req, start, n = s.request, s.start, s.num_new_tokens
        ids.extend(req.tokens(start, start + n))
        pos.extend(range(start, start + n))
        slots.extend(kv.slot_mapping(req.request_id, start, start + n))
        if s.samples:
            logits_idx.append(len(ids) - 1)
            sampling.append(s)
        if req.sampling_params.prompt_logprobs is not None and (span := prompt_positions(req, start, n)):
            prompt_rows.append((req, *span))
            prompt_idx.extend(range(len(ids) - n + span[0] - start, len(ids) - n + span[1] - start))

    def t(x):
        return torch.tensor(x, dtype=torch.long, device=device)

    groups = []
    i = 0
    while i < len(decodes):
        # a group spans context lengths (in blocks) within a factor of two: padding < 2x
        lo = cdiv(decodes[i].start + 1, bs)
        j = i
        while j < len(decodes) and cdiv(decodes[j].start + 1, bs) <= 2 * lo:
            j += 1
        members = decodes[i:j]
        width = cdiv(members[-1].start + 1, bs)
        tables = [kv.get_block_table(s.request.request_id)[:width] for s in members]
        ctx = t([s.start + 1 for s in members])
        mask = (torch.arange(width * bs, device=device)[None, :] < ctx[:, None])[:, None, None, :]
        groups.append(DecodeGroup(i, t([tb + [0] * (width - len(tb)) for tb in tables]), mask, ctx))
        i = j
    meta = AttentionMetadata(
        slot_mapping=t(slots),
        num_decode=len(decodes),
        decode_groups=groups,
        prefill_query_lens=[s.num_new_tokens for s in prefills],
        prefill_context_lens=[s.start + s.num_new_tokens for s in prefills],
        prefill_block_tables=[
            t(kv.get_block_table(s.request.request_id)[: cdiv(s.start + s.num_new_tokens, bs)]) for s in prefills
        ],
    )
    return ModelInput(t(ids), t(pos), meta, t(logits_idx + prompt_idx), sampling, decodes + prefills, prompt_rows)


class ModelRunner:
    """Runs a model (or one rank's shard) on one device and owns its KV cache tensors, per layer
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.

    Args:
        model: the loaded model (weights already on ``device`` in their dtype).
        num_blocks, block_size: the pool's shape.
        kv_dtype, device: the cache's dtype and device.
        attention_backend: ``"auto"``, ``"torch"``, ``"cpu"``, ``"triton"`` or ``"triton-interpret"``
            (:mod:`workbench.attention.backend`); the Triton backends also do the block copies.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        device,
        num_cpu_blocks: int = 0,
        attention_backend: str = "auto",
    ):
        self.model = model
        self.attn_backend = get_backend(attention_backend, device, kv_dtype)
        cfg = model.config
        attn = model.layers[0].self_attn  # KV heads of this rank's shard under tensor parallelism
        shape = (2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        # zeros, not empty: attention reads whole blocks and masks the unwritten slots, and a NaN bit pattern left in
        # uninitialised memory would survive the mask (0 x NaN = NaN)
        self.kv_caches = [torch.zeros(shape, dtype=kv_dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.device = torch.device(device)
        cpu_shape = (2, num_cpu_blocks, *shape[2:])
        pin = self.device.type == "cuda"
        cpu_layers = cfg.num_hidden_layers if num_cpu_blocks else 0  # no swap space: no CPU tensors
        self.cpu_caches = [torch.zeros(cpu_shape, dtype=kv_dtype, pin_memory=pin) for _ in range(cpu_layers)]

    def copy_blocks(
        self, swap_out: list[tuple[int, int]], copies: list[tuple[int, int]], swap_in: list[tuple[int, int]]
    ) -> None:
        """Block copies of one step, in this order: device -> CPU (swap out), device -> device (copy-on-write),
        CPU -> device (swap in). Each pair is ``(src, dst)`` block ids; device copies run in list order."""
        if hasattr(self.attn_backend, "copy_blocks"):  # the Triton gather / copy / scatter kernels
            self.attn_backend.copy_blocks(self.kv_caches, self.cpu_caches, swap_out, copies, swap_in)
            return

        def idx(pairs, i, dev):
            return torch.tensor([p[i] for p in pairs], dtype=torch.long, device=dev)

        for layer, gpu in enumerate(self.kv_caches):
            if swap_out:
                self.cpu_caches[layer][:, idx(swap_out, 1, "cpu")] = gpu[:, idx(swap_out, 0, gpu.device)].to("cpu")
            for r in copy_rounds(copies):  # in list order (workbench.kv.moves)
                gpu[:, idx(r, 1, gpu.device)] = gpu[:, idx(r, 0, gpu.device)]
            if swap_in:
                gpu[:, idx(swap_in, 1, gpu.device)] = self.cpu_caches[layer][:, idx(swap_in, 0, "cpu")].to(gpu.device)

    @torch.inference_mode()
    def execute_model(self, inp: ModelInput) -> torch.Tensor:
        """Logits ``[num_sampling, vocab_size]`` (float32) of the sampling tokens."""
        inp.meta.backend = self.attn_backend
        return self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta, inp.logits_indices)


class ModelExecutor:
    """What the executors of a real model share: the model's files, the memory budget, the step.

    Built from ``config`` (the engine arguments); raises ``FileNotFoundError`` / ``ValueError`` if the model cannot
    be read (see :func:`workbench.model.loader.load_model`). Subclasses build the model for a length
    (:meth:`load_model`), measure the activation peak (:meth:`profile_activation_peak`), allocate the cache
    (:meth:`init_cache`) and run a forward (``execute_model(ModelInput) -> logits``) and block copies (``copy_blocks``).
    """

    comm_buffer_bytes = 0
    stats = None  # cumulative CommStats of tensor-parallel executors

    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        self.device = config.torch_device
        loaded = load_model(config.model, config.resolved_cache_dir, config.tokenizer)
        self.hf_config, self.tokenizer, self.model_folder = loaded.hf_config, loaded.tokenizer, loaded.folder
        self._state_dict = loaded.state_dict
        self.model_name = "the model's"
        self.max_position_embeddings = getattr(self.hf_config, "max_position_embeddings", None)
        self.eos_token_id = loaded.eos_token_id
        self.load_time_s = time.perf_counter() - t0

    def memory_budget(self, max_model_len: int, max_num_batched_tokens: int) -> MemoryBudget:
        """The KV budget after vLLM's profile run (:func:`workbench.memory.engine_budget`)."""
        return engine_budget(
            self.config,
            self.hf_config,
            self.model.weight_bytes(),
            self.comm_buffer_bytes,
            max_model_len,
            max_num_batched_tokens,
            self.profile_activation_peak,
        )

    def check_fits(self, memory: MemoryBudget, num_cpu_blocks: int) -> None:
        """Refuse a pool this machine cannot hold (:func:`workbench.memory.check_fits`)."""
        check_fits(memory, self.device, num_cpu_blocks)

    @torch.inference_mode()
    def execute_step(self, out: SchedulerOutput, kv: KVManager) -> ModelRunnerOutput:
        """Run one step: block copies, inputs laid out from the block tables, forward, sampling."""
        t0 = time.perf_counter()
        comm0 = self.stats.copy() if self.stats is not None else None
        if out.swap_out or out.block_copies or out.swap_in:
            self.copy_blocks(out.swap_out, out.block_copies, out.swap_in)
            if self.device.type == "cuda":  # the copies are timed on their own
                torch.cuda.synchronize(self.device)
        copy_s = time.perf_counter() - t0
        if out.is_empty:
            return ModelRunnerOutput({}, copy_s, copy_time_s=copy_s)
        inp = prepare_inputs(out, kv, self.device)
        logits = self.execute_model(inp)
        t1 = time.perf_counter()
        reqs = [s.request for s in inp.sampling]
        errors: dict[int, str] = {}
        params, gens = [r.sampling_params for r in reqs], [r.generator for r in reqs]
        toks = sample(logits[: len(reqs)], params, gens, reqs, errors)
        failed = {reqs[i].request_id: why for i, why in errors.items()}
        if failed:  # a failed row has no token: it gets no logprobs and no update
            keep = [i for i in range(len(reqs)) if i not in errors]
            logits = torch.cat([logits[keep], logits[len(reqs) :]])
            reqs, toks = [reqs[i] for i in keep], [toks[i] for i in keep]
        lps = step_logprobs(logits, reqs, toks, inp.prompt_rows) if inp.prompt_rows or any_logprobs(reqs) else (None,)
        comm = self.stats.since(comm0) if comm0 is not None else None
        sampled = {r.request_id: t for r, t in zip(reqs, toks)}
        sample_s = time.perf_counter() - t1
        return ModelRunnerOutput(sampled, t1 - t0, sample_s, 0, comm, *lps, copy_time_s=copy_s, failed=failed)

    def shutdown(self) -> None:
        """Release what the executor holds (worker processes); idempotent."""


class LocalExecutor(ModelExecutor):
    """The model in this process, on ``config.device`` in ``config.dtype``."""

    def load_model(self, max_model_len: int) -> None:
        """Build the model with RoPE tables for ``max_model_len`` positions and load its weights."""
        c = self.config
        self.model = build_model(self.hf_config, self._state_dict, max_model_len, c.torch_dtype, self.device)
        del self._state_dict

    def profile_activation_peak(self, num_tokens: int, max_model_len: int, max_num_seqs: int, block_size: int) -> int:
        key = (str(self.model_folder), str(self.config.torch_dtype), str(self.device))
        return profile_activation_peak(self.model, num_tokens, max_model_len, max_num_seqs, block_size, key=key)

    def init_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate the KV cache tensors (and the CPU swap pool's)."""
        c = self.config
        self.runner = ModelRunner(
            self.model, num_blocks, c.block_size, c.kv_torch_dtype, self.device, num_cpu_blocks, c.attention_backend
        )
        self.kv_caches, self.attn_backend = self.runner.kv_caches, self.runner.attn_backend

    def copy_blocks(self, swap_out, copies, swap_in) -> None:
        self.runner.copy_blocks(swap_out, copies, swap_in)

    def execute_model(self, inp: ModelInput) -> torch.Tensor:
        """Logits ``[num_sampling, vocab_size]`` (float32) of the sampling tokens."""
        return self.runner.execute_model(inp)

"""The memory budget: how many KV blocks the device can hold (docs/architecture.md §3).

    KV budget = capacity × gpu_memory_utilization − weights − activation peak − communication buffers
                − memory outside PyTorch − other PyTorch tensors            (the last two: CUDA only)
    num_blocks = KV budget // block bytes,   block bytes = block_size × KV bytes per token

KV bytes per token = 2 (K and V) × num_hidden_layers × num_key_value_heads × head_dim ×
bytes of the KV dtype (vLLM paper, Kwon et al., SOSP 2023, §3; vLLM's
``vllm/utils.get_kv_cache_torch_dtype`` and cache engine).

Capacity: on CUDA the device's total memory (``torch.cuda.mem_get_info``, with the
device's name and NVML's view of used memory from ``pynvml`` when it is present); on CPU
the declared ``device_memory``.

The activation peak is *profiled*, as vLLM's ``profile_run`` does: one dummy forward of
``max_num_batched_tokens`` prompt tokens (sequences of at most ``max_model_len`` tokens,
float32 logits for up to ``max_num_seqs`` rows) while the peak of the memory it allocates
is measured — on CUDA with ``torch.cuda.max_memory_allocated``; on CPU, where PyTorch keeps
no allocator statistics, by :class:`LiveTensorBytes`, which follows every tensor the forward
creates and frees (a ``TorchDispatchMode``). On CUDA, memory used outside PyTorch (the CUDA
context, NCCL, other processes; the device's used − PyTorch's reserved) is subtracted too, and so
is what PyTorch already held in this process before the profile besides the weights (other
tensors, another engine, cuBLAS's workspace once a matmul has run, as ``tests/test_cuda.py`` shows; see
docs/benchmarks.md, section "The memory budget on a real GPU"), as vLLM's profiler starts from a baseline
snapshot. Communication buffers are 0 on one device; under tensor parallelism they are measured on CUDA and
modelled elsewhere (:mod:`workbench.executor.tensor_parallel`, :func:`workbench.comm.nccl_buffer_bytes`), and every
figure is one rank's (its shard of the weights, its KV heads).

``kv_cache_memory_bytes`` and ``num_gpu_blocks_override`` bypass the profile, as in vLLM.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import asdict, dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from workbench.config import EngineConfig

log = logging.getLogger("workbench")


def kv_bytes_per_token(hf_config, kv_dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    """Bytes of K and V for one token across all layers (one rank's share under TP).

    Args:
        hf_config: a transformers config with ``num_hidden_layers``, ``num_key_value_heads``,
            ``num_attention_heads``, ``hidden_size`` and optionally ``head_dim``.
        kv_dtype: dtype of the cache.
        tensor_parallel_size: ranks the KV heads are split across.
    """
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    per_rank_heads = max(1, kv_heads // tensor_parallel_size)
    elem = torch.empty((), dtype=kv_dtype).element_size()
    return 2 * hf_config.num_hidden_layers * per_rank_heads * head_dim * elem


def activation_peak_bytes(hf_config, max_num_batched_tokens: int, max_num_seqs: int, dtype: torch.dtype) -> int:
    """Analytical estimate (bytes) of one forward's largest live tensors: the hidden state, fused
    QKV and gate/up outputs and float32 logits. Used by ``kv-calc`` and as a cross-check of the
    profile (:func:`profile_activation_peak`), which is what the engine uses."""
    elem = torch.empty((), dtype=dtype).element_size()
    h = hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    qkv = (hf_config.num_attention_heads + 2 * hf_config.num_key_value_heads) * head_dim
    per_token = (4 * h + qkv + 3 * hf_config.intermediate_size) * elem
    logits = max_num_seqs * hf_config.vocab_size * 4
    return max_num_batched_tokens * per_token + logits


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of the tensors created while the mode is active (CPU or any device).

    Every aten op's outputs are followed: an output whose storage is new counts its bytes until
    the last tensor viewing that storage is freed; views and in-place results of tensors that
    existed before (weights, the KV cache) count nothing. Workspace an op allocates and frees
    inside itself is not seen, so the figure is a lower bound of the true peak by that much.

    Attributes:
        current: bytes live now.
        peak: most bytes live at once since the mode was entered.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, list[int]] = {}  # storage data_ptr -> [bytes, tensors alive]

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.layout == torch.strided
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                continue
            st = t.untyped_storage()
            key, nbytes = st.data_ptr(), st.nbytes()
            if nbytes == 0:
                continue
            if key in self._live:
                self._live[key][1] += 1
            elif key in inputs:
                continue  # a view or in-place result of a tensor from before the profile
            else:
                self._live[key] = [nbytes, 1]
                self.current += nbytes
                self.peak = max(self.peak, self.current)
            weakref.finalize(t, self._release, key)
        return out


def _dummy_batch(num_tokens: int, max_model_len: int, max_num_seqs: int, block_size: int, vocab: int, device):
    """Inputs of a profile forward: prompts of at most ``max_model_len`` tokens, logits for up to
    ``max_num_seqs`` rows. Returns ``(input_ids, positions, meta, logits_indices, num_blocks)``."""
    from workbench.attention import AttentionMetadata

    lens = []
    left = num_tokens
    while left > 0:
        lens.append(min(left, max_model_len))
        left -= lens[-1]
    ids, pos, slots, tables = [], [], [], []
    block = 0
    for n in lens:
        nb = -(-n // block_size)
        tables.append(torch.arange(block, block + nb, device=device))
        slots.extend(range(block * block_size, block * block_size + n))
        pos.extend(range(n))
        block += nb
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (num_tokens,), generator=g).to(device)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        num_decode=0,
        decode_groups=[],
        prefill_query_lens=lens,
        prefill_context_lens=lens,
        prefill_block_tables=tables,
    )
    rows = min(max_num_seqs, num_tokens)
    logits_idx = torch.arange(num_tokens - rows, num_tokens, device=device)
    return ids, torch.tensor(pos, device=device), meta, logits_idx, block


_PROFILES: dict[tuple, int] = {}


def _profile(model, num_tokens, max_model_len, max_num_seqs, block_size) -> int:
    cfg = model.config
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    ids, pos, meta, logits_idx, nb = _dummy_batch(
        num_tokens, max_model_len, max_num_seqs, block_size, cfg.vocab_size, device
    )
    # one small cache shared by every layer: its size is not an activation
    kv_heads = model.layers[0].self_attn.num_kv_heads  # this rank's heads under tensor parallelism
    cache = torch.zeros((2, nb, block_size, kv_heads, head_dim), dtype=dtype, device=device)
    caches = [cache] * cfg.num_hidden_layers
    with torch.inference_mode():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            model(ids, pos, caches, meta, logits_idx)
            torch.cuda.synchronize(device)
            return int(torch.cuda.max_memory_allocated(device) - before)
        mode = LiveTensorBytes()
        with mode:
            logits = model(ids, pos, caches, meta, logits_idx)
            del logits
        return int(mode.peak)


def profile_activation_peak(
    model, num_tokens: int, max_model_len: int, max_num_seqs: int, block_size: int, key=None
) -> int:
    """Measured peak bytes of one forward at ``num_tokens`` tokens (see the module docstring).

    Args:
        model: a :class:`~workbench.model.llama.LlamaForCausalLM` on its device and dtype.
        num_tokens: tokens of the profile batch (``max_num_batched_tokens``).
        max_model_len: longest sequence in it (tokens).
        max_num_seqs: rows of logits computed (the most sequences that sample in one step).
        block_size: tokens per block of the dummy cache.
        key: a hashable identity of the model's architecture and dtype; equal keys reuse an
            earlier measurement in this process (engines built again on the same model).

    Returns:
        bytes (the dummy cache excluded).
    """
    if key is None:
        return _profile(model, num_tokens, max_model_len, max_num_seqs, block_size)
    k = (key, num_tokens, max_model_len, max_num_seqs, block_size)
    if k not in _PROFILES:
        _PROFILES[k] = _profile(model, num_tokens, max_model_len, max_num_seqs, block_size)
    return _PROFILES[k]


def nvml_memory(device_index: int = 0) -> dict | None:
    """``{"name", "total", "used"}`` (bytes) of an NVIDIA device from NVML, or ``None``.

    Returns ``None``, silently, when the ``nvidia-ml-py`` package or an NVIDIA driver is absent.
    """
    try:
        import pynvml  # from nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            info = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            return {"name": name.decode() if isinstance(name, bytes) else name, "total": info.total, "used": info.used}
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None


@dataclass
class MemoryBudget:
    """Where the device memory goes, in bytes (and the KV pool in blocks and tokens).

    Attributes:
        capacity_bytes: device total (CUDA) or declared ``device_memory`` (CPU).
        weights_bytes: the model's parameters.
        activation_bytes: profiled peak of one forward at ``max_num_batched_tokens`` (0 when a
            bypass set the pool size).
        non_torch_bytes: CUDA memory used outside PyTorch (context, NCCL, other processes) at
            startup; 0 on CPU.
        other_torch_bytes: CUDA memory PyTorch already held in this process before the profile run,
            besides the weights (other tensors, another engine, cuBLAS's workspace); 0 on CPU.
        comm_buffer_bytes: communication buffers (0 on one device).
        kv_budget_bytes: what is left for the KV pool.
        source: ``"cpu device_memory"``, ``"cuda"``, ``"kv_cache_memory_bytes"`` or
            ``"num_gpu_blocks_override"``.
        device_name: the GPU's name (from NVML or CUDA), ``"cpu"`` otherwise.
    """

    capacity_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    activation_bytes: int
    comm_buffer_bytes: int
    kv_budget_bytes: int
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    max_model_len: int
    source: str
    non_torch_bytes: int = 0
    device_name: str = "cpu"
    other_torch_bytes: int = 0

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def kv_pool_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """Sequences of ``max_model_len`` tokens the pool holds at once."""
        return self.kv_pool_tokens / self.max_model_len

    def summary_line(self) -> str:
        mib = 1 << 20
        act = (
            f"activations {self.activation_bytes / mib:,.1f} MiB (profiled)"
            if self.source in ("cuda", "cpu device_memory")
            else f"activations {self.activation_bytes / mib:,.1f} MiB (estimate)"
            if self.source == "simulated"  # workbench.sim: no model to profile
            else "activations not profiled"
        )
        other = f" | outside torch {self.non_torch_bytes / mib:,.1f} MiB" if self.non_torch_bytes else ""
        if self.other_torch_bytes:
            other += f" | other torch tensors {self.other_torch_bytes / mib:,.1f} MiB"
        return (
            f"memory budget ({self.source}): capacity {self.capacity_bytes / mib:,.0f} MiB x "
            f"{self.gpu_memory_utilization} | weights {self.weights_bytes / mib:,.1f} MiB | "
            f"{act} | buffers {self.comm_buffer_bytes / mib:,.1f} MiB{other} | "
            f"KV pool {self.kv_pool_bytes / mib:,.1f} MiB = {self.num_blocks:,} blocks x {self.block_size} tokens "
            f"= {self.kv_pool_tokens:,} tokens ({self.kv_bytes_per_token:,} B/token) | "
            f"max concurrency {self.max_concurrency:.2f}x at max_model_len={self.max_model_len}"
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            block_bytes=self.block_bytes,
            kv_pool_bytes=self.kv_pool_bytes,
            kv_pool_tokens=self.kv_pool_tokens,
            max_concurrency=self.max_concurrency,
        )
        return d


def device_capacity(device: torch.device, device_memory: int | None) -> tuple[int, int, str]:
    """``(capacity, used outside PyTorch, device name)`` in bytes.

    CUDA: total from ``torch.cuda.mem_get_info``; used outside PyTorch = (total - free) -
    ``torch.cuda.memory_reserved``; the name from NVML when available. CPU: ``device_memory``.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        outside = max(0, (total - free) - torch.cuda.memory_reserved(device))
        nv = nvml_memory(device.index or 0)
        name = nv["name"] if nv else torch.cuda.get_device_name(device)
        return int(total), int(outside), name
    return int(device_memory), 0, "cpu"


def plan_memory(
    *,
    hf_config,
    device: torch.device,
    device_memory: int | None,
    gpu_memory_utilization: float,
    weights_bytes: int,
    kv_dtype: torch.dtype,
    block_size: int,
    max_model_len: int,
    activation_bytes: int = 0,
    comm_buffer_bytes: int = 0,
    other_torch_bytes: int = 0,
    num_gpu_blocks_override: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    tensor_parallel_size: int = 1,
) -> MemoryBudget:
    """Compute the budget and the number of KV blocks.

    ``KV budget = capacity x gpu_memory_utilization - weights - activation peak - memory used
    outside PyTorch - other PyTorch tensors - communication buffers``;
    ``num_blocks = KV budget // block bytes``.
    ``kv_cache_memory_bytes`` (then ``num_blocks = it // block bytes``) and
    ``num_gpu_blocks_override`` bypass it (vLLM's engine arguments of the same names).

    Args:
        activation_bytes: the profiled peak (:func:`profile_activation_peak`).
        other_torch_bytes: CUDA bytes PyTorch held before the profile besides the weights (0 on CPU).

    Raises:
        ValueError: the budget leaves no room for KV, or the pool cannot hold one
            ``max_model_len`` sequence (names the pool in tokens, the requested length,
            the largest length that fits, and how to fix it).
    """
    per_token = kv_bytes_per_token(hf_config, kv_dtype, tensor_parallel_size)
    block_bytes = per_token * block_size
    capacity, outside, name = device_capacity(device, device_memory)
    source = "cuda" if device.type == "cuda" else "cpu device_memory"
    act = activation_bytes
    outside += other_torch_bytes  # both are in use and not the engine's: subtracted alike
    budget = int(capacity * gpu_memory_utilization) - weights_bytes - act - outside - comm_buffer_bytes
    mib = 1 << 20
    if num_gpu_blocks_override is not None:
        num_blocks = num_gpu_blocks_override
        source = "num_gpu_blocks_override"
        budget = num_blocks * block_bytes
    elif kv_cache_memory_bytes is not None:
        num_blocks = kv_cache_memory_bytes // block_bytes
        source = "kv_cache_memory_bytes"
        budget = kv_cache_memory_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={kv_cache_memory_bytes:,} holds no KV block of {block_bytes:,} bytes "
                f"(block_size={block_size} x {per_token:,} B/token); give at least {max_model_len * per_token:,} "
                f"bytes to hold one max_model_len={max_model_len:,} sequence"
            )
    else:
        if budget < block_bytes:
            enough = weights_bytes + act + outside + comm_buffer_bytes + max_model_len * per_token
            enough /= gpu_memory_utilization
            raise ValueError(
                f"not enough memory for the KV cache: capacity {capacity / mib:,.0f} MiB x gpu_memory_utilization "
                f"{gpu_memory_utilization} - weights {weights_bytes / mib:,.1f} MiB - activations {act / mib:,.1f} MiB"
                f" - other {(outside + comm_buffer_bytes) / mib:,.1f} MiB = {budget / mib:,.1f} MiB, not even one "
                f"block. One max_model_len={max_model_len:,} sequence needs {max_model_len * per_token / mib:,.1f} "
                f"MiB: give at least {enough / mib:,.0f} MiB (device_memory / gpu_memory_utilization), or lower "
                "max_model_len or max_num_batched_tokens (the activation peak grows with it)"
            )
        num_blocks = budget // block_bytes
    mb = MemoryBudget(
        capacity_bytes=capacity,
        gpu_memory_utilization=gpu_memory_utilization,
        weights_bytes=weights_bytes,
        activation_bytes=act,
        comm_buffer_bytes=comm_buffer_bytes,
        kv_budget_bytes=max(budget, 0),
        kv_bytes_per_token=per_token,
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        source=source,
        non_torch_bytes=outside - other_torch_bytes,
        other_torch_bytes=other_torch_bytes,
        device_name=name,
    )
    if mb.kv_pool_tokens < max_model_len:
        raise ValueError(
            f"the KV pool holds {mb.kv_pool_tokens:,} tokens ({num_blocks:,} blocks x {block_size}), fewer than "
            f"max_model_len={max_model_len:,}: one sequence of that length cannot fit. Set max_model_len <= "
            f"{mb.kv_pool_tokens:,}, or give the KV cache more memory (device_memory, gpu_memory_utilization, "
            f"kv_cache_memory_bytes, num_gpu_blocks_override; {max_model_len:,} tokens need "
            f"{max_model_len * per_token / mib:,.1f} MiB)"
        )
    return mb


#: largest pool (blocks) for which ``block_map_every`` may record per-block pictures
MAX_BLOCK_MAP_BLOCKS = 65_536


def swap_pool_blocks(config, memory: MemoryBudget) -> int:
    """Blocks of the CPU swap pool (``swap_space`` GiB; 0 unless ``preemption_mode="swap"``).

    Raises:
        ValueError: ``block_map_every`` asked of a pool over ``MAX_BLOCK_MAP_BLOCKS`` blocks, or a
            ``swap_space`` that holds no block (naming the value and the fix).
    """
    m = memory
    if config.block_map_every and m.num_blocks > MAX_BLOCK_MAP_BLOCKS:
        raise ValueError(
            f"block_map_every={config.block_map_every} records a picture of every block, but the pool has "
            f"{m.num_blocks:,} blocks (more than {MAX_BLOCK_MAP_BLOCKS:,}); size the pool with "
            "num_gpu_blocks_override or kv_cache_memory_bytes, raise block_size, or set block_map_every=0"
        )
    if config.preemption_mode != "swap":
        return 0
    num_cpu_blocks = int(config.swap_space * (1 << 30)) // m.block_bytes
    if num_cpu_blocks < 1:
        raise ValueError(
            f"swap_space={config.swap_space} GiB holds no KV block of {m.block_bytes:,} B; "
            "raise swap_space or use preemption_mode='recompute'"
        )
    return num_cpu_blocks


def check_fits(memory: MemoryBudget, device: torch.device, num_cpu_blocks: int = 0) -> None:
    """Refuse a KV pool the machine cannot hold, before allocating it.

    CPU: the pool, the swap pool and the weights against the machine's physical memory (a
    ``device_memory`` or ``num_gpu_blocks_override`` larger than the RAM would otherwise end in
    an allocation failure or the OOM killer). CUDA: the pool against the device's free memory.

    Raises:
        ValueError: naming the sizes and the fix.
    """
    m = memory
    gib = 1 << 30
    swap = num_cpu_blocks * m.block_bytes
    if device.type == "cpu":
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
    elif device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        if m.kv_pool_bytes > free:
            raise ValueError(
                f"the KV pool ({m.kv_pool_bytes / gib:,.2f} GiB = {m.num_blocks:,} blocks) exceeds the device's "
                f"free memory ({free / gib:,.2f} GiB); lower gpu_memory_utilization, num_gpu_blocks_override "
                "or kv_cache_memory_bytes"
            )


def engine_budget(
    config,
    hf_config,
    weights_bytes: int,
    comm_buffer_bytes: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    profile,
) -> MemoryBudget:
    """The memory budget of an engine over a real model (:func:`plan_memory` with its arguments).

    vLLM's profile run: unless ``num_gpu_blocks_override`` or ``kv_cache_memory_bytes`` size the pool,
    ``profile(num_tokens, max_model_len, max_num_seqs, block_size)`` measures the activation peak of
    one forward at the step's token budget. On CPU the capacity is ``device_memory`` (default
    ``EngineConfig.DEFAULT_CPU_DEVICE_MEMORY``).
    """
    c = config
    device = c.torch_device
    device_memory = c.device_memory
    if device_memory is None and device.type == "cpu":
        device_memory = c.DEFAULT_CPU_DEVICE_MEMORY
    activation = 0
    # what PyTorch holds already besides the weights, before the profile (which may add cuBLAS's workspace
    # and count it as activation): subtracted once, from this baseline, as vLLM's memory profiler does
    other_torch = max(0, torch.cuda.memory_allocated(device) - weights_bytes) if device.type == "cuda" else 0
    if c.num_gpu_blocks_override is None and c.kv_cache_memory_bytes is None:
        activation = profile(max_num_batched_tokens, max_model_len, c.max_num_seqs, c.block_size)
    return plan_memory(
        hf_config=hf_config,
        device=device,
        device_memory=device_memory,
        gpu_memory_utilization=c.gpu_memory_utilization,
        weights_bytes=weights_bytes,
        kv_dtype=c.kv_torch_dtype,
        block_size=c.block_size,
        max_model_len=max_model_len,
        activation_bytes=activation,
        num_gpu_blocks_override=c.num_gpu_blocks_override,
        kv_cache_memory_bytes=c.kv_cache_memory_bytes,
        tensor_parallel_size=c.tensor_parallel_size,
        comm_buffer_bytes=comm_buffer_bytes,
        other_torch_bytes=other_torch,
    )


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

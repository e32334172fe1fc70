"""KV-cache and weight sizes of a model from its architecture alone (the calculator of ``workbench kv-calc``;
its command and printer live in :mod:`workbench.cli.kv_calc`).

Formulas (docs/architecture.md §3; vLLM paper, Kwon et al., SOSP 2023, §3):

    KV bytes per token (per GPU) = 2 (K and V) × num_hidden_layers × kv_heads_per_rank × head_dim
                                   × bytes of kv_cache_dtype,   kv_heads_per_rank = max(1, num_kv_heads // tp)
    block bytes                  = block_size (tokens) × KV bytes per token
    weights (per GPU)            = parameters of one rank (ModelArch.param_breakdown) × bytes of dtype
    KV budget (per GPU)          = capacity × gpu_memory_utilization − weights − activation reserve
    blocks                       = KV budget // block bytes;   tokens = blocks × block_size
    sequences of seq_len         = blocks // ceil(seq_len / block_size)

KV heads are replicated when ``tp > num_key_value_heads`` (vLLM's ``QKVParallelLinear``), so
the per-GPU cache stops shrinking there. The activation reserve (transient tensors of a
forward, CUDA graphs, NCCL buffers) is an explicit estimate: a size the caller gives (default
0), or ``"estimate"``: :func:`workbench.memory.activation_peak_bytes` at
``max_num_batched_tokens`` / ``max_num_seqs`` — the analytical bound of one unsharded forward,
an overestimate per GPU under TP. The engine profiles the real peak at startup.

Sources of an architecture (:func:`load_arch`; nothing is downloaded): a catalogue name
(:mod:`workbench.catalog`), a Hugging Face repository id that a catalogue entry cites
(``meta-llama/Llama-2-70b-hf`` → ``llama-2-70b``), a ``config.json`` file, an HF model folder, a
``.gguf`` file (metadata read by transformers' GGUF support), or ``"bundled"`` for the bundled
model's GGUF.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from workbench.catalog import HF_REPO_ID, MODELS, GPUSpec, ModelArch, find_gpu, find_model, find_model_by_repo, repo_of
from workbench.memory import kv_bytes_per_token
from workbench.model.shapes import arch_from_hf_config
from workbench.units import parse_size  # the one size parser; importable from here as before

WEIGHT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
#: KV-cache dtypes (vLLM's names; ``fp8`` = ``fp8_e4m3``). ``auto`` = the weights' dtype.
KV_DTYPES = {
    **WEIGHT_DTYPES,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def fmt_bytes(n: float) -> str:
    """``n`` bytes in binary units (``"1.50 GiB"``), with the exact count below 1 KiB."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{sign}{n / scale:,.2f} {unit}"
    return f"{sign}{n:,.0f} B"


# ----------------------------------------------------------------------------- architectures


def load_arch(model: str) -> ModelArch:
    """The architecture behind ``model``.

    Args:
        model: a catalogue name (``"llama-2-13b"``; case and ``-``/``_`` ignored), ``"bundled"`` (the
            bundled model's GGUF file), a Hugging Face repository id that a catalogue entry's source
            cites (``"meta-llama/Llama-2-70b-hf"``; an existing local path of that name wins), a
            ``config.json`` path (any ``.json``), an HF model folder (its ``config.json``), or a
            ``.gguf`` file.

    Raises:
        FileNotFoundError: a path that does not exist, a folder without ``config.json``, or the
            bundled package missing.
        ValueError: not a catalogue name and not a path (lists the catalogue), a repository id no
            catalogue entry cites (lists the catalogue and the repositories it cites), or a file
            that transformers cannot read as a config.
    """
    from transformers import AutoConfig

    arch = find_model(model)
    if arch is not None:
        return arch
    if model.strip().lower() == "bundled":
        from workbench.model.loader import bundled_model_path

        path = bundled_model_path()
    else:
        path = Path(model).expanduser()
    if not path.exists() and HF_REPO_ID.match(model.strip()):
        by_repo = find_model_by_repo(model)
        if by_repo is not None:
            return by_repo
        cited = ", ".join(f"{m.name} ({repo_of(m)})" for m in MODELS.values())
        raise ValueError(
            f"model={model!r} is not a local path, and no catalogue entry cites that Hugging Face repository "
            f"(nothing is downloaded); the catalogue: {cited}. Give a catalogue name, or a local config.json, "
            "HF model folder or .gguf file"
        )
    if not path.exists():
        looks_like_path = "/" in model or "\\" in model or path.suffix in (".json", ".gguf") or model.startswith(".")
        if looks_like_path:
            raise FileNotFoundError(f"model={model!r}: no such file or folder")
        raise ValueError(
            f"model={model!r} is neither in the catalogue ({', '.join(MODELS)}) nor an existing path; "
            "give a catalogue name, a config.json, an HF model folder or a .gguf file (workbench kv-calc --list)"
        )
    path = path.resolve()
    try:
        if path.is_dir():
            if not (path / "config.json").exists():
                raise FileNotFoundError(f"model={model!r}: the folder has no config.json (expected an HF model folder)")
            cfg = AutoConfig.from_pretrained(str(path))
        elif path.suffix == ".gguf":
            cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        elif path.suffix == ".json":
            cfg = AutoConfig.from_pretrained(str(path))
        else:
            raise ValueError(f"model={model!r}: expected a config.json, an HF model folder or a .gguf file")
    except (OSError, KeyError, ValueError) as e:
        if isinstance(e, FileNotFoundError) or "expected a config.json" in str(e):
            raise
        raise ValueError(f"model={model!r}: transformers cannot read it as a model config ({e})") from None
    return arch_from_hf_config(cfg, name=str(path), source=str(path))


# ----------------------------------------------------------------------------- the calculation


@dataclass
class KVCalcResult:
    """Sizes of one model on one GPU of a tensor-parallel group. Bytes unless named otherwise.

    Attributes:
        arch: the architecture.
        resolved: how MODEL was read, when not literally (``"meta-llama/Llama-2-70b-hf → catalogue
            entry llama-2-70b"``), else ``""``.
        dtype, kv_cache_dtype: dtype names of weights and KV cache.
        tensor_parallel_size: GPUs the model is split over.
        kv_heads_per_rank: KV heads each GPU holds.
        kv_bytes_per_token: KV bytes of one token on one GPU (all layers).
        kv_bytes_per_token_all_gpus: the same summed over the tensor-parallel group (replicas included).
        block_size: tokens per KV block. block_bytes: bytes of one block on one GPU.
        params_total: parameters of the model. params_per_gpu: of one rank.
        weights_bytes_per_gpu: ``params_per_gpu`` × bytes of ``dtype``.
        seq_len: tokens of one sequence (prompt + output), or ``None``.
        kv_bytes_per_seq: bytes of the blocks one ``seq_len`` sequence takes on one GPU, or ``None``.
        gpu: the catalogue GPU, or ``None`` (memory given as a number, or not at all).
        gpu_memory_bytes: capacity of one GPU, or ``None`` (then the fields below are ``None``).
        gpu_memory_utilization: share of the capacity the engine may use.
        activation_reserve_bytes: the estimate of non-KV, non-weight memory per GPU.
        activation_reserve_how: where ``activation_reserve_bytes`` comes from.
        kv_budget_bytes: capacity × utilization − weights − reserve (negative when weights do not fit).
        num_blocks, kv_tokens: KV blocks and tokens that fit on each GPU (every GPU holds its
            share of the same tokens, so ``kv_tokens`` is also the group's).
        max_sequences: whole ``seq_len`` sequences that fit at once (paged: each takes
            ``ceil(seq_len / block_size)`` blocks).
        max_concurrency: vLLM's figure, ``kv_tokens / seq_len``.
        fits: weights fit and the pool holds one ``seq_len`` sequence (one block without seq_len).
        suggestions: how to make it fit, when it does not (computed alternatives).
        notes: caveats (e.g. ``seq_len`` beyond ``max_position_embeddings``).
    """

    arch: ModelArch
    dtype: str
    kv_cache_dtype: str
    tensor_parallel_size: int
    kv_heads_per_rank: int
    kv_bytes_per_token: int
    kv_bytes_per_token_all_gpus: int
    block_size: int
    block_bytes: int
    params_total: int
    params_per_gpu: int
    weights_bytes_per_gpu: int
    seq_len: int | None = None
    kv_bytes_per_seq: int | None = None
    gpu: GPUSpec | None = None
    gpu_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    activation_reserve_bytes: int = 0
    activation_reserve_how: str = "given"
    kv_budget_bytes: int | None = None
    num_blocks: int | None = None
    kv_tokens: int | None = None
    max_sequences: int | None = None
    max_concurrency: float | None = None
    fits: bool | None = None
    suggestions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    resolved: str = ""

    @property
    def weights_fit(self) -> bool | None:
        """Weights and the reserve fit in capacity × utilization (``None`` without a GPU)."""
        return None if self.kv_budget_bytes is None else self.kv_budget_bytes > 0

    def verdict(self) -> str:
        """One line: does it fit, and how many sequences (or why not)."""
        if self.gpu_memory_bytes is None:
            return "no GPU memory given (--gpu or --gpu-memory): sizes only"
        where = f"{self.tensor_parallel_size} x {self._gpu_name()}"
        usable = self.gpu_memory_bytes * self.gpu_memory_utilization
        if not self.weights_fit:
            return (
                f"DOES NOT FIT on {where}: weights {fmt_bytes(self.weights_bytes_per_gpu)} + reserve "
                f"{fmt_bytes(self.activation_reserve_bytes)} per GPU exceed capacity x utilization "
                f"{fmt_bytes(usable)}"
            )
        if not self.fits:
            need = f"one {self.seq_len:,}-token sequence" if self.seq_len else "one KV block"
            return (
                f"DOES NOT FIT on {where}: weights fit, but the KV budget {fmt_bytes(self.kv_budget_bytes)} "
                f"per GPU holds {self.num_blocks:,} blocks, less than {need}"
            )
        line = f"FITS on {where}: {self.kv_tokens:,} tokens of KV cache"
        if self.seq_len:
            line += (
                f", {_sequences(self.max_sequences)} of {self.seq_len:,} tokens at once "
                f"(max concurrency {self.max_concurrency:.2f}x)"
            )
        return line

    def _gpu_name(self) -> str:
        return self.gpu.name if self.gpu else f"GPU of {fmt_bytes(self.gpu_memory_bytes)}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["arch"]["num_params"] = self.params_total
        d["weights_fit"] = self.weights_fit
        d["verdict"] = self.verdict()
        return d


def _resolve_dtype(name: str, table: dict, what: str) -> torch.dtype:
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"{what}={name!r} is not supported; use one of {', '.join(table)}") from None


def kv_calc(
    model: str | ModelArch,
    *,
    dtype: str = "float16",
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int = 1,
    block_size: int = 16,
    gpu: str | GPUSpec | None = None,
    gpu_memory: str | int | None = None,
    gpu_memory_utilization: float = 0.9,
    activation_reserve: str | int = 0,
    seq_len: int | None = None,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 64,
) -> KVCalcResult:
    """KV bytes per token and per block, weights, and what fits on a GPU — from the architecture alone.

    Args:
        model: an architecture, or anything :func:`load_arch` accepts.
        dtype: weights' dtype (``float16``, ``bfloat16``, ``float32``).
        kv_cache_dtype: ``auto`` (= ``dtype``), a weight dtype, or ``fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``.
        tensor_parallel_size: GPUs the model is split over (Megatron-style, as in vLLM).
        block_size: tokens per KV block.
        gpu: a catalogue GPU name (:data:`workbench.catalog.GPUS`); its memory is per GPU.
        gpu_memory: memory of one GPU instead (bytes, or a size string as :func:`parse_size`).
        gpu_memory_utilization: share of the capacity for weights + reserve + KV, in (0, 1].
        activation_reserve: bytes per GPU kept for activations and buffers (a size; default 0), or
            ``"estimate"`` (module docstring).
        seq_len: tokens of one sequence, for ``max_sequences``.
        max_num_batched_tokens, max_num_seqs: the batch ``"estimate"`` assumes (the engine's defaults).

    Returns:
        A :class:`KVCalcResult`; the GPU fields are ``None`` when neither ``gpu`` nor ``gpu_memory`` is given.

    Raises:
        ValueError: an unknown dtype, a tensor-parallel size that does not split the model, a
            non-positive ``block_size`` / ``seq_len``, ``gpu_memory_utilization`` outside (0, 1],
            both ``gpu`` and ``gpu_memory``, an unknown GPU, or a bad size; and what :func:`load_arch` raises.
        FileNotFoundError: see :func:`load_arch`.
    """
    arch = model if isinstance(model, ModelArch) else load_arch(model)
    by_repo = isinstance(model, str) and (repo_of(arch) or "").lower() == model.strip().lower()
    w_dtype = _resolve_dtype(dtype, WEIGHT_DTYPES, "dtype")
    kv_name = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    kv_dtype = _resolve_dtype(kv_name, KV_DTYPES, "kv_cache_dtype")
    tp = tensor_parallel_size
    arch.check_tensor_parallel(tp)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be a positive number of tokens (vLLM uses 16)")
    if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
        raise ValueError(f"seq_len={seq_len!r} must be a positive number of tokens")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1], e.g. 0.9")
    if gpu is not None and gpu_memory is not None:
        raise ValueError("give either gpu (a catalogue name) or gpu_memory (bytes of one GPU), not both")

    if activation_reserve == "estimate":
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} and max_num_seqs={max_num_seqs} must be >= 1"
            )
        from workbench.memory import activation_peak_bytes

        reserve = activation_peak_bytes(arch, max_num_batched_tokens, max_num_seqs, w_dtype)
        reserve_how = (
            f"estimate: activations of one unsharded forward of {max_num_batched_tokens:,} tokens, "
            f"{max_num_seqs} sequences"
        )
    else:
        try:
            reserve = parse_size(activation_reserve, allow_zero=True)
        except ValueError as e:
            raise ValueError(f"activation_reserve: {e}, or 'estimate'") from None
        reserve_how = "given: --activation-reserve" if reserve else "none kept: --activation-reserve 0, the default"
    per_token = kv_bytes_per_token(arch, kv_dtype, tp)
    elem = torch.empty((), dtype=w_dtype).element_size()
    params_rank = arch.num_params(tp)
    res = KVCalcResult(
        arch=arch,
        dtype=dtype,
        kv_cache_dtype=kv_name,
        tensor_parallel_size=tp,
        kv_heads_per_rank=arch.kv_heads_per_rank(tp),
        kv_bytes_per_token=per_token,
        kv_bytes_per_token_all_gpus=per_token * tp,
        block_size=block_size,
        block_bytes=per_token * block_size,
        params_total=arch.num_params(1),
        params_per_gpu=params_rank,
        weights_bytes_per_gpu=params_rank * elem,
        seq_len=seq_len,
        activation_reserve_bytes=reserve,
        activation_reserve_how=reserve_how,
        resolved=f"{model.strip()} → catalogue entry {arch.name}" if by_repo else "",
    )
    blocks_per_seq = math.ceil(seq_len / block_size) if seq_len else 1
    if seq_len:
        res.kv_bytes_per_seq = blocks_per_seq * res.block_bytes
        if arch.max_position_embeddings and seq_len > arch.max_position_embeddings:
            res.notes.append(
                f"seq_len={seq_len:,} exceeds the model's max_position_embeddings={arch.max_position_embeddings:,}"
            )
    if tp > arch.num_key_value_heads:
        res.notes.append(
            f"tensor_parallel_size={tp} > num_key_value_heads={arch.num_key_value_heads}: each GPU holds a "
            "replica of one KV head (as in vLLM)"
        )
    if gpu is None and gpu_memory is None:
        return res

    res.gpu = gpu if isinstance(gpu, GPUSpec) else (find_gpu(gpu) if gpu is not None else None)
    res.gpu_memory_bytes = res.gpu.memory_bytes if res.gpu else parse_size(gpu_memory)
    res.gpu_memory_utilization = gpu_memory_utilization
    budget = int(res.gpu_memory_bytes * gpu_memory_utilization) - res.weights_bytes_per_gpu
    budget -= res.activation_reserve_bytes
    res.kv_budget_bytes = budget
    res.num_blocks = max(budget, 0) // res.block_bytes
    res.kv_tokens = res.num_blocks * block_size
    if seq_len:
        res.max_sequences = res.num_blocks // blocks_per_seq
        res.max_concurrency = res.kv_tokens / seq_len
    res.fits = res.num_blocks >= blocks_per_seq
    if not res.fits:
        res.suggestions = _suggestions(arch, res)
    return res


def _suggestions(arch: ModelArch, res: KVCalcResult) -> list[str]:
    """Computed ways to make ``res`` fit: a larger tensor-parallel size, a smaller dtype."""
    out = []
    common = dict(
        block_size=res.block_size,
        gpu_memory=res.gpu_memory_bytes,
        gpu_memory_utilization=res.gpu_memory_utilization,
        activation_reserve=res.activation_reserve_bytes,
        seq_len=res.seq_len,
    )
    for tp in arch.valid_tensor_parallel_sizes():
        if tp <= res.tensor_parallel_size:
            continue
        alt = kv_calc(arch, dtype=res.dtype, kv_cache_dtype=res.kv_cache_dtype, tensor_parallel_size=tp, **common)
        if alt.fits:
            seqs = f", {_sequences(alt.max_sequences)} of {res.seq_len:,}" if res.seq_len else ""
            out.append(
                f"--tensor-parallel-size {tp}: weights {fmt_bytes(alt.weights_bytes_per_gpu)} per GPU, "
                f"{alt.kv_tokens:,} tokens{seqs}"
            )
            break
    if res.dtype == "float32":
        alt = kv_calc(
            arch, dtype="bfloat16", kv_cache_dtype="auto", tensor_parallel_size=res.tensor_parallel_size, **common
        )
        out.append(
            f"--dtype bfloat16: weights {fmt_bytes(alt.weights_bytes_per_gpu)} per GPU, "
            + (f"{alt.kv_tokens:,} tokens" if alt.fits else "still does not fit")
        )
    if res.kv_cache_dtype not in ("fp8", "fp8_e4m3", "fp8_e5m2") and res.weights_fit:
        alt = kv_calc(
            arch, dtype=res.dtype, kv_cache_dtype="fp8", tensor_parallel_size=res.tensor_parallel_size, **common
        )
        if alt.fits:
            out.append(f"--kv-cache-dtype fp8: {alt.kv_tokens:,} tokens")
    if not out:
        out.append("a GPU with more memory, a higher --gpu-memory-utilization, or a smaller --activation-reserve")
    return out


def _sequences(n: int) -> str:
    """``"1 sequence"``, ``"3 sequences"``."""
    return f"{n:,} sequence{'' if n == 1 else 's'}"

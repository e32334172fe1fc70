"""Chapter 1, the anatomy of the KV cache: the memory budget of a real engine, the claims it checks, KV bytes per
token of catalogue models and whether they fit.

The notebook ``labs/01_kv_cache_anatomy.ipynb`` calls these, one call per cell; its exercises are at the end."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from workbench.labs.exercise_registry import _close, _number, _register
from workbench.labs.runs import (
    lab_engine,
)

# the memory budget (budget_figure, budget_rows): the run report shows the same parts, named alike
from workbench.viz.budget import budget_figure, budget_rows  # noqa: F401
from workbench.viz.table import Column, Table

MiB = 1 << 20


def _mib(v: float) -> str:
    return f"{v / MiB:,.1f}"


def budget_table(memory: dict) -> Table:
    """The budget (:func:`budget_rows`) in MiB, the capacity, and the pool in blocks and tokens (a note).

    Rows ``{"part", "bytes"}``."""
    rows = [{"part": n, "bytes": b} for n, b in budget_rows(memory)]
    rows.append({"part": "capacity", "bytes": memory["capacity_bytes"]})
    return Table(
        [Column("part", "part", align="left"), Column("bytes", "MiB", _mib)],
        rows,
        title="Where the device memory goes",
        notes=[
            f"KV pool: {memory['num_blocks']:,} blocks x {memory['block_size']} tokens = "
            f"{memory['kv_pool_tokens']:,} tokens at {memory['kv_bytes_per_token']:,} B/token"
        ],
    )


def claims_check() -> list[dict[str, str]]:
    """Figures that circulate in course material, measured with kv-calc and the engine.

    Returns rows ``{"claim", "measured", "verdict"}``. The measurements: KV bytes per token and per
    block from each model's config (``workbench.kvcalc.kv_calc``, float16 cache, one GPU), and the
    bytes of one block in the running engine's own cache tensors (bundled model).
    """
    from workbench.kvcalc import fmt_bytes, kv_calc

    r13 = kv_calc("llama-2-13b", dtype="float16")
    blocks = {m: kv_calc(m, dtype="float16", block_size=16) for m in ("llama-2-7b", "llama-2-13b", "llama-2-70b")}
    eng = engine_block_bytes()
    layer_block = {m: r.block_bytes // r.arch.num_hidden_layers // 2 for m, r in blocks.items()}
    whole = [r.block_bytes for r in blocks.values()] + [eng]
    per_layer = list(layer_block.values())
    return [
        {
            "claim": "Llama-2-13B needs about 40 KB of KV cache per token",
            "measured": f"{r13.kv_bytes_per_token:,} B = {fmt_bytes(r13.kv_bytes_per_token)} per token "
            f"(one layer's K+V: {fmt_bytes(r13.kv_bytes_per_token // r13.arch.num_hidden_layers)})",
            "verdict": f"wrong by {r13.kv_bytes_per_token / 40_000:.0f}x: {fmt_bytes(r13.kv_bytes_per_token)} per token",
        },
        {
            "claim": "vLLM's block manager splits memory into 16 MB blocks",
            "measured": "block_size=16 is tokens; one block (all layers, K+V) = "
            + ", ".join(f"{m} {fmt_bytes(r.block_bytes)}" for m, r in blocks.items())
            + f"; the bundled model in this engine's cache tensors: {fmt_bytes(eng)}",
            "verdict": f"wrong unit: a block is 16 tokens; its bytes depend on the model "
            f"({fmt_bytes(min(whole))} to {fmt_bytes(max(whole))} here), none of them 16 MB",
        },
        {
            "claim": "block sizes are 16-64 KB",
            "measured": "vLLM's block_size choices are 8, 16, 32 (tokens); one layer's K (or V) block at 16 tokens: "
            + ", ".join(f"{m} {fmt_bytes(b)}" for m, b in layer_block.items()),
            "verdict": f"wrong unit: block sizes are in tokens; in bytes one layer's K block is "
            f"{fmt_bytes(min(per_layer))} to {fmt_bytes(max(per_layer))}, a whole block "
            f"{fmt_bytes(min(whole))} to {fmt_bytes(max(whole))}",
        },
    ]


def engine_block_bytes(**engine_args: Any) -> int:
    """Bytes of one KV block in a real engine's cache tensors (all layers, K and V), measured from
    the tensors themselves: ``sum(t.nbytes for t in kv_caches) / num_blocks``."""
    llm = lab_engine(**({"num_gpu_blocks_override": 32} | engine_args))
    ex = llm.llm_engine.executor
    caches = getattr(ex, "kv_caches", [])
    return sum(t.numel() * t.element_size() for t in caches) // llm.llm_engine.memory.num_blocks


def claims_table(rows: Sequence[dict[str, str]]) -> Table:
    """:func:`claims_check` as a table: for each claim, the claim, what was measured and the verdict
    (three lines). Rows ``{"n", "what", "text"}``."""
    out = []
    for i, r in enumerate(rows, 1):
        out += [
            {"n": i, "what": "claim", "text": r["claim"]},
            {"n": None, "what": "measured", "text": r["measured"]},
            {"n": None, "what": "verdict", "text": r["verdict"]},
        ]
    return Table(
        [
            Column("n", "#", lambda v: "" if v is None else str(v)),
            Column("what", "", align="left"),
            Column("text", "", align="left", prose=True),
        ],
        out,
        title="Claims in circulation, measured",
        header=False,
    )


def kv_table(models: Sequence[str], dtype: str = "float16", block_size: int = 16) -> Table:
    """KV bytes per token and per block of catalogue models (``workbench kv-calc``), one row each.

    Rows ``{"model", "layers", "kv_heads", "head_dim", "kv_bytes_per_token", "block_bytes"}`` (bytes)."""
    from workbench.kvcalc import KV_DTYPES, fmt_bytes, kv_calc

    rows = []
    for m in models:
        r = kv_calc(m, dtype=dtype, block_size=block_size)
        a = r.arch
        rows.append(
            {
                "model": m,
                "layers": a.num_hidden_layers,
                "kv_heads": a.num_key_value_heads,
                "head_dim": a.head_dim,
                "kv_bytes_per_token": r.kv_bytes_per_token,
                "block_bytes": r.block_bytes,
            }
        )
    elem = KV_DTYPES[dtype].itemsize
    return Table(
        [
            Column("model", "model", align="left"),
            Column("layers", "layers"),
            Column("kv_heads", "KV heads"),
            Column("head_dim", "head_dim"),
            Column("kv_bytes_per_token", "KV per token", fmt_bytes),
            Column("block_bytes", f"KV per block of {block_size} tokens", fmt_bytes),
        ],
        rows,
        notes=[f"(K and V of every layer, a {dtype} cache: {elem} bytes per element; one GPU, no tensor parallelism)"],
    )


def fits_table(
    cases: Sequence[tuple[str, str, int]], seq_len: int = 4096, gpu_memory_utilization: float = 0.9
) -> Table:
    """``kv-calc``'s verdict for ``(model, gpu, tensor_parallel_size)`` cases (float16, no activation reserve).

    Rows ``{"model", "gpu", "tensor_parallel_size", "fits", "verdict"}``."""
    from workbench.kvcalc import kv_calc

    rows = []
    for model, gpu, tp in cases:
        r = kv_calc(
            model, gpu=gpu, tensor_parallel_size=tp, seq_len=seq_len, gpu_memory_utilization=gpu_memory_utilization
        )
        rows.append({"model": model, "gpu": gpu, "tensor_parallel_size": tp, "fits": r.fits, "verdict": r.verdict()})
    return Table(
        [Column("model", "model", align="left"), Column("verdict", "kv-calc's verdict", align="left", prose=True)],
        rows,
        title=f"Does it fit? float16, sequences of {seq_len:,} tokens, gpu_memory_utilization {gpu_memory_utilization:g}",
    )


# ---------------------------------------------------------------- exercises
@_register(
    "1.1",
    "How many bytes of KV cache does one token take in Llama-2-13B with a float16 cache "
    "(40 layers, 40 KV heads, head_dim 128)? Give bytes, for the whole model on one GPU.",
    "2 (K and V) x layers x KV heads x head_dim x bytes per element (docs/architecture.md §3).",
)
class _KVBytes13B:
    @staticmethod
    def solution() -> int:
        return 2 * 40 * 40 * 128 * 2

    @staticmethod
    def judge(answer) -> tuple[bool, str]:
        ref = _KVBytes13B.solution()
        x = _number(answer)
        if x is None:
            return False, f"give a number of bytes, got {answer!r}"
        if x == ref:
            return True, f"{ref:,} B = {ref / 1024:,.0f} KiB per token — about 20x the '40 KB' claim"
        if _close(x, ref / 1024) or _close(x, ref / 1000):
            return False, "that is the figure in KiB/KB; the question asks for bytes"
        if _close(x, ref / 2):
            return False, "you counted K or V, not both: multiply by 2"
        if _close(x, ref / 40):
            return False, "that is one layer's share; every layer keeps its own K and V"
        return False, f"{x:,.0f} B is not it; recount the five factors"


def reference_kv_bytes_per_token(config: dict, dtype_bytes: int) -> int:
    """KV bytes per token from a config dict (keys as in a Hugging Face ``config.json``)."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def _catalogue_configs() -> list[tuple[str, dict]]:
    from workbench.catalog import MODELS

    out = []
    for name, arch in MODELS.items():
        cfg = {
            "num_hidden_layers": arch.num_hidden_layers,
            "num_attention_heads": arch.num_attention_heads,
            "num_key_value_heads": arch.num_key_value_heads,
            "hidden_size": arch.hidden_size,
        }
        if arch.head_dim != arch.hidden_size // arch.num_attention_heads:  # as config.json: only when it differs
            cfg["head_dim"] = arch.head_dim
        out.append((name, cfg))
    return out


@_register(
    "1.2",
    "Write kv_bytes_per_token(config, dtype_bytes) for a Hugging Face config dict; it is checked "
    "against kv-calc on every model of the catalogue (grouped-query attention included).",
    "use num_key_value_heads (not num_attention_heads) and head_dim = hidden_size // num_attention_heads "
    "when the config has no head_dim.",
)
class _KVBytesFn:
    @staticmethod
    def solution():
        return reference_kv_bytes_per_token

    @staticmethod
    def judge(answer) -> tuple[bool, str]:
        from workbench.kvcalc import kv_calc

        if not callable(answer):
            return False, f"give a function, got {type(answer).__name__}"
        for name, cfg in _catalogue_configs():
            for dtype, nbytes in (("float16", 2), ("float32", 4)):
                ref = kv_calc(name, dtype=dtype).kv_bytes_per_token
                got = answer(dict(cfg), nbytes)
                if got != ref:
                    return False, f"{name} ({dtype}): your function gives {got!r}, kv-calc {ref:,} B"
        return True, f"matches kv-calc on all {len(_catalogue_configs())} catalogue models, float16 and float32"


@_register(
    "1.3",
    "How many whole sequences of 4,096 tokens can this engine's KV pool hold at once (paged)?",
    "each sequence holds ceil(4096 / block_size) blocks; the pool has memory['num_blocks'] blocks.",
)
class _MaxSeqs:
    @staticmethod
    def solution(memory: dict) -> int:
        return memory["num_blocks"] // math.ceil(4096 / memory["block_size"])

    @staticmethod
    def judge(answer, memory: dict) -> tuple[bool, str]:
        ref = _MaxSeqs.solution(memory)
        x = _number(answer)
        if x is None:
            return False, f"give a whole number of sequences, got {answer!r}"
        if x == ref:
            return True, f"{ref} sequences ({memory['num_blocks']:,} blocks / {math.ceil(4096 / memory['block_size'])})"
        if _close(x, memory["kv_pool_tokens"] / 4096):
            return False, "that is vLLM's 'max concurrency' (tokens / 4096), not whole sequences: round down by blocks"
        return False, f"{answer} is not it"

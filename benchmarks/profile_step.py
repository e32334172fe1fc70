"""Where an engine step's time goes: scheduling, input preparation, the model forward (attention,
linear layers, the rest), sampling and recording.

The engine (bundled SmolLM2-135M-Instruct, CPU, ``--dtype``: ``auto`` = the engine's own choice,
bfloat16 where the CPU has native bfloat16) generates greedily for the same prompts as
``offline_throughput.py`` (fewer by default), four times on one ``LLM``:

1. warm-up on a few prompts;
2. a **timed run**: ``StepStats`` (schedule / model / sample / wall time of every step) plus
   ``time.perf_counter`` wrappers, installed by this script only, around
   ``workbench.executor.local.prepare_inputs``, the executor's ``execute_model``,
   the attention backend's ``paged_attention`` / ``write_kv`` and ``LLMEngine._record_step``;
3. the same run under **cProfile** (Python-level view; profiling slows Python-heavy code, so its
   seconds are larger than the timed run's);
4. the same run again, stepping the engine by hand, with **torch.profiler** on ``--profile-steps``
   steps spread over the run. Its op tree splits the forward into attention (everything under
   ``paged_attention`` and ``write_kv``: gathers through the block tables, SDPA, the KV write),
   linear layers (``aten::linear`` / ``addmm`` / ``mm`` / ``matmul`` outside attention) and the
   rest (norms, RoPE, SiLU, embedding, residual adds, Python between ops). Those shares, applied
   to the timed run's forward seconds, give the forward rows of the table.

Nothing in the package is edited: the wrappers are set on module attributes and on the engine
object by this script. Example::

    python benchmarks/profile_step.py                      # 32 prompts x 64 tokens
    python benchmarks/profile_step.py --num-prompts 4 --max-tokens 8   # smoke test
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import io
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from offline_throughput import REPO, load_engine, load_token_prompts, machine_info  # same folder

DEFAULT_OUT = REPO / "runs" / "bench" / "profile_step.json"
LINEAR_OPS = {"aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "mkldnn::_linear_pointwise"}  # the last: bf16
LABEL_ATTN = "wb::paged_attention"
LABEL_KV_WRITE = "wb::write_kv"
LABEL_FORWARD = "wb::forward"
ATTN_SDPA = {"aten::scaled_dot_product_attention"}
ATTN_GATHER = {"aten::index", "aten::index_select"}


class Timers:
    """Accumulated seconds and call counts of the wrapped functions."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def wrap(self, name: str, fn, label: str | None = None):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if label is not None:
                with torch.profiler.record_function(label):
                    t0 = time.perf_counter()
                    try:
                        return fn(*args, **kwargs)
                    finally:
                        self.seconds[name] += time.perf_counter() - t0
                        self.calls[name] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1

        return wrapper


def instrument(llm, timers: Timers) -> None:
    """Install the timing / labelling wrappers (module attributes and the engine object only)."""
    import workbench.executor.local as executor_mod

    eng = llm.llm_engine
    # the model calls its attention backend (the reference, or the C++ decode kernel's); wrap its two methods
    attn = eng.executor.attn_backend
    attn.paged_attention = timers.wrap("attention", attn.paged_attention, LABEL_ATTN)
    attn.write_kv = timers.wrap("kv_write", attn.write_kv, LABEL_KV_WRITE)
    if getattr(attn, "_ext", None) is not None:  # the cpu backend: time its two C++ kernels apart
        attn._ext = _TimedKernels(attn._ext, timers)
    executor_mod.prepare_inputs = timers.wrap("prepare_inputs", executor_mod.prepare_inputs, "wb::prepare_inputs")
    eng.executor.execute_model = timers.wrap("forward", eng.executor.execute_model, LABEL_FORWARD)
    eng._record_step = timers.wrap("record_step", eng._record_step, "wb::record_step")
    proc = eng.output  # request outputs: detokenize, stop strings, RequestOutput objects
    proc.make_outputs = timers.wrap("output", proc.make_outputs, "wb::output")


class _TimedKernels:
    """The C++ extension as the cpu backend sees it, with its two attention kernels timed apart."""

    def __init__(self, ext, timers: Timers) -> None:
        self._ext = ext
        self.paged_decode_attention = timers.wrap("decode_kernel", ext.paged_decode_attention)
        self.paged_decode_attention_rowwise = timers.wrap("decode_kernel", ext.paged_decode_attention_rowwise)
        self.paged_attention = timers.wrap("chunk_kernel", ext.paged_attention)

    def __getattr__(self, name):
        return getattr(self._ext, name)


def sampling_params(max_tokens: int):
    from workbench import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def timed_run(llm, prompts, max_tokens: int, timers: Timers) -> dict:
    eng = llm.llm_engine
    first = len(eng.recorder.steps)
    timers.reset()
    gc.collect()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sampling_params(max_tokens))
    wall = time.perf_counter() - t0
    steps = eng.recorder.steps[first:]
    return {
        "wall_s": wall,
        "steps": steps,
        "timers": dict(timers.seconds),
        "calls": dict(timers.calls),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
    }


def breakdown(run: dict, shares: dict[str, float]) -> list[dict]:
    """Rows (name, seconds, share of generate()'s wall time) of the timed run."""
    steps, t = run["steps"], run["timers"]
    wall = run["wall_s"]
    sched = sum(s.schedule_time_s for s in steps)
    model = sum(s.model_time_s for s in steps)  # prepare_inputs + forward (StepStats' "model" phase)
    sample = sum(s.sample_time_s for s in steps)
    step_wall = sum(s.wall_time_s for s in steps)
    prep = t.get("prepare_inputs", 0.0)
    fwd = t.get("forward", model - prep)
    update = step_wall - sched - model - sample
    record = t.get("record_step", 0.0)
    output = t.get("output", 0.0)
    other = wall - step_wall - record - output
    rows = [
        ("scheduling (Scheduler.schedule)", sched, 0),
        ("input preparation (prepare_inputs)", prep, 0),
        ("model forward (execute_model)", fwd, 0),
        ("  attention (paged_attention + write_kv)", fwd * shares.get("attention", 0.0), 1),
        ("  linear layers (qkv/o/gate_up/down/lm_head)", fwd * shares.get("linear", 0.0), 1),
        ("  rest (norms, RoPE, SiLU, embedding, adds, Python)", fwd * shares.get("rest", 0.0), 1),
        ("  (StepStats model - prepare - forward)", model - prep - fwd, 1),
        ("sampling (sample)", sample, 0),
        ("rest of the step (Scheduler.update, bookkeeping)", update, 0),
        ("recording (_record_step: StepStats, KV usage)", record, 0),
        ("request outputs (_output: detokenize, records)", output, 0),
        ("other (add_request, tokenize, generate loop)", other, 0),
    ]
    out = [{"name": n, "seconds": s, "share": s / wall if wall else 0.0, "level": lvl} for n, s, lvl in rows]
    out.append({"name": "total: LLM.generate wall time", "seconds": wall, "share": 1.0, "level": 0})
    return out


def torch_profile(llm, prompts, max_tokens: int, num_steps_expected: int, profile_steps: int) -> dict:
    """Step the engine by hand; run torch.profiler on ``profile_steps`` steps spread over the run."""
    from torch.profiler import ProfilerActivity, profile

    eng = llm.llm_engine
    sp = sampling_params(max_tokens)
    for i, p in enumerate(prompts):
        eng.add_request(f"prof-{i}", p, sp)
    stride = max(1, num_steps_expected // max(1, profile_steps))
    acc: dict[str, float] = defaultdict(float)  # microseconds
    attn_sub: dict[str, float] = defaultdict(float)
    rest_ops: dict[str, float] = defaultdict(float)
    linear_ops: dict[str, float] = defaultdict(float)
    profiled = []
    step = 0
    first = len(eng.recorder.steps)
    while eng.has_unfinished_requests():
        if step % stride == 0 and len(profiled) < profile_steps:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                eng.step()
            profiled.append(step)
            _accumulate(prof.events(), acc, attn_sub, rest_ops, linear_ops)
        else:
            eng.step()
        step += 1
    steps = eng.recorder.steps[first:]
    kinds = {
        i: {"prefill_tokens": steps[i].num_prefill_tokens, "decode_tokens": steps[i].num_decode_tokens}
        for i in profiled
        if i < len(steps)
    }
    fwd = acc["forward"]
    parts = {k: acc[k] for k in ("attention", "linear", "rest")}
    total = sum(parts.values()) or 1.0
    return {
        "profiled_steps": profiled,
        "profiled_step_tokens": kinds,
        "num_steps": step,
        "forward_us": fwd,
        "forward_parts_us": parts,
        "shares": {k: v / total for k, v in parts.items()},
        "attention_parts_us": dict(attn_sub),
        "linear_ops_us": dict(sorted(linear_ops.items(), key=lambda kv: -kv[1])),
        "rest_top_ops_us": dict(sorted(rest_ops.items(), key=lambda kv: -kv[1])[:15]),
    }


def _accumulate(events, acc, attn_sub, rest_ops, linear_ops) -> None:
    """Split every ``wb::forward`` range into attention / linear / rest (inclusive CPU microseconds)."""

    def top_named(ev, names) -> float:  # inclusive time of the top-most descendants named in `names`
        total = 0.0
        for c in ev.cpu_children:
            total += c.cpu_time_total if c.name in names else top_named(c, names)
        return total

    def walk(ev) -> None:
        name = ev.name
        if name in (LABEL_ATTN, LABEL_KV_WRITE):
            acc["attention"] += ev.cpu_time_total
            if name == LABEL_KV_WRITE:
                attn_sub["kv write (write_kv: index_copy_)"] += ev.cpu_time_total
            else:
                sdpa = top_named(ev, ATTN_SDPA)
                gather = top_named(ev, ATTN_GATHER)
                attn_sub["sdpa (aten::scaled_dot_product_attention)"] += sdpa
                attn_sub["gather K/V (aten::index / index_select)"] += gather
                attn_sub["other (views, casts, copies, Python)"] += ev.cpu_time_total - sdpa - gather
        elif name in LINEAR_OPS:
            acc["linear"] += ev.cpu_time_total
            linear_ops[name] += ev.cpu_time_total
        else:
            self_us = ev.self_cpu_time_total
            acc["rest"] += self_us
            rest_ops["(Python between ops)" if name == LABEL_FORWARD else name] += self_us
            for c in ev.cpu_children:
                walk(c)

    for ev in events:
        if ev.name == LABEL_FORWARD:
            acc["forward"] += ev.cpu_time_total
            walk(ev)


def cprofile_run(llm, prompts, max_tokens: int, top: int, prof_path: Path | None) -> dict:
    """The run under cProfile: phase functions' cumulative seconds and the top functions by own time."""
    prof = cProfile.Profile()
    gc.collect()
    t0 = time.perf_counter()
    prof.enable()
    llm.generate(prompts, sampling_params(max_tokens))
    prof.disable()
    wall = time.perf_counter() - t0
    if prof_path is not None:
        prof_path.parent.mkdir(parents=True, exist_ok=True)
        prof.dump_stats(str(prof_path))
    stats = pstats.Stats(prof, stream=io.StringIO())
    phases = {
        "LLM.generate": ("workbench/entrypoints/llm.py", "generate"),
        "LLMEngine.step": ("workbench/engine.py", "step"),
        "Scheduler.schedule": ("workbench/scheduler.py", "schedule"),
        "prepare_inputs": ("workbench/executor/local.py", "prepare_inputs"),
        "execute_model (forward)": ("workbench/executor/local.py", "execute_model"),
        "paged_attention (cpu backend: C++ decode)": ("workbench/attention/cpu_backend.py", "paged_attention"),
        "paged_attention (reference)": ("workbench/attention/torch_ref.py", "paged_attention"),
        "write_kv": ("workbench/attention/torch_ref.py", "write_kv"),
        "sample": ("workbench/sampling.py", "sample"),
        "Scheduler.update": ("workbench/scheduler.py", "update"),
        "LLMEngine._record_step": ("workbench/engine.py", "_record_step"),
        "PoolAccounting.observe": ("workbench/metrics/accounting.py", "observe"),
        "LLMEngine._output": ("workbench/engine.py", "_output"),
        "LLMEngine.add_request": ("workbench/engine.py", "add_request"),
    }
    cum: dict[str, dict] = {}
    for label, (file_end, func) in phases.items():
        hits = [(k, v) for k, v in stats.stats.items() if k[0].endswith(file_end) and k[2] == func]
        if hits:  # (this script's wrappers live in this file, so only the package's functions match)
            _, (_, nc, tt, ct, _) = max(hits, key=lambda kv: kv[1][3])
            cum[label] = {"calls": nc, "cumulative_s": ct, "own_s": tt}
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    top_rows = [{"function": _short(k), "calls": v[1], "own_s": v[2], "cumulative_s": v[3]} for k, v in rows]
    return {"wall_s": wall, "phases": cum, "top_by_own_time": top_rows}


def _short(key) -> str:
    file, line, func = key
    if file == "~":
        return func
    for marker in ("site-packages/", str(REPO) + "/"):
        if marker in file:
            file = file.split(marker, 1)[1]
            break
    return f"{file}:{line}({func})"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=32, help="first N prompts (default 32)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request, EOS ignored (default 64)")
    p.add_argument("--max-prompt-len", type=int, default=1024, help="cut prompts to this many tokens (default 1024)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="engine max_num_seqs (default 64)")
    p.add_argument("--max-batch-tokens", type=int, default=2048, help="engine max_num_batched_tokens (default 2048)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument(
        "--dtype", default="auto", choices=("auto", "float32", "bfloat16"), help="engine dtype (default auto)"
    )
    p.add_argument(
        "--attention-backend",
        default="auto",
        help="engine attention_backend (default auto: the C++ decode kernel on a CPU in bfloat16, else the reference)",
    )
    p.add_argument("--profile-steps", type=int, default=12, help="steps under torch.profiler (default 12)")
    p.add_argument("--top", type=int, default=20, help="cProfile functions to list (default 20)")
    p.add_argument("--dataset", default=None, help="prompt file (default: ShareGPT 500 if present, else defaults)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"JSON output (default {DEFAULT_OUT.relative_to(REPO)})")
    p.add_argument("--no-prof-file", action="store_true", help="do not write the cProfile .prof beside the JSON")
    args = p.parse_args(argv)
    for name in ("num_prompts", "max_tokens", "max_prompt_len", "profile_steps", "top"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    machine = machine_info()
    llm = load_engine(args.max_num_seqs, args.max_batch_tokens, args.dtype, args.attention_backend)
    dtype = str(llm.llm_engine.config.torch_dtype).removeprefix("torch.")
    prompts, prompt_info = load_token_prompts(llm.tokenizer, args.num_prompts, args.max_prompt_len, args.dataset)
    print(
        f"# {machine['cpu_model']} | {machine['cpus_available']} CPUs | torch {machine['torch']} "
        f"({torch.get_num_threads()} threads) | {dtype} | {len(prompts)} prompts ({prompt_info['prompt_tokens']} tokens) "
        f"x {args.max_tokens} output tokens",
        flush=True,
    )
    timers = Timers()
    instrument(llm, timers)

    llm.generate(prompts[:4], sampling_params(min(8, args.max_tokens)))  # warm-up
    run = timed_run(llm, prompts, args.max_tokens, timers)
    print(f"# timed run: {run['wall_s']:.2f}s, {len(run['steps'])} steps", flush=True)
    out = Path(args.out)
    prof_path = None if args.no_prof_file else out.with_suffix(".prof")
    cprof = cprofile_run(llm, prompts, args.max_tokens, args.top, prof_path)
    print(f"# cProfile run: {cprof['wall_s']:.2f}s", flush=True)
    tprof = torch_profile(llm, prompts, args.max_tokens, len(run["steps"]), args.profile_steps)
    print(f"# torch.profiler on steps {tprof['profiled_steps']} of {tprof['num_steps']}", flush=True)

    rows = breakdown(run, tprof["shares"])
    steps = run["steps"]
    print()
    print(
        f"Engine step profile: {len(prompts)} prompts, {args.max_tokens} output tokens each, "
        f"{len(steps)} steps ({sum(s.num_prefill_tokens for s in steps)} prefill + "
        f"{sum(s.num_decode_tokens for s in steps)} decode tokens), {dtype}, {torch.get_num_threads()} torch threads"
    )
    print()
    print("| phase | seconds | share |")
    print("|---|---:|---:|")
    for r in rows:
        print(f"| {r['name']} | {r['seconds']:.3f} | {r['share']:.1%} |")
    t = run["timers"]
    print()
    print(
        f"directly timed in the timed run: paged_attention {t.get('attention', 0.0):.3f}s, "
        f"write_kv {t.get('kv_write', 0.0):.3f}s (the attention row uses the profiler's share instead)"
    )
    if "decode_kernel" in t or "chunk_kernel" in t:
        print(
            f"  of paged_attention: C++ decode kernel {t.get('decode_kernel', 0.0):.3f}s "
            f"({run['calls'].get('decode_kernel', 0)} calls), C++ chunk kernel {t.get('chunk_kernel', 0.0):.3f}s "
            f"({run['calls'].get('chunk_kernel', 0)} calls)"
        )
    print()
    print("torch.profiler, forward split (profiled steps, CPU ms):")
    for k, v in tprof["forward_parts_us"].items():
        print(f"  {k:<10} {v / 1e3:9.1f} ms  {tprof['shares'][k]:.1%}")
    print("  attention parts:")
    for k, v in tprof["attention_parts_us"].items():
        print(f"    {k:<45} {v / 1e3:9.1f} ms")
    print("  top ops in 'rest' (self time):")
    for k, v in list(tprof["rest_top_ops_us"].items())[:8]:
        print(f"    {k:<45} {v / 1e3:9.1f} ms")
    print()
    print(f"cProfile (run took {cprof['wall_s']:.2f}s under the profiler), cumulative seconds:")
    for k, v in cprof["phases"].items():
        print(f"  {k:<26} {v['cumulative_s']:8.3f}s  ({v['calls']} calls)")
    print(f"cProfile top {min(10, args.top)} by own time:")
    for r in cprof["top_by_own_time"][:10]:
        print(f"  {r['own_s']:8.3f}s  {r['calls']:>8}  {r['function']}")

    report = {
        "benchmark": "profile_step",
        "command": " ".join(["python", "benchmarks/profile_step.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine,
        "settings": {
            "num_prompts": len(prompts),
            "max_tokens": args.max_tokens,
            "max_prompt_len": args.max_prompt_len,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": llm.llm_engine.max_num_batched_tokens,
            "torch_num_threads": torch.get_num_threads(),
            "profile_steps": args.profile_steps,
            "dtype": dtype,
            "dtype_arg": args.dtype,
            "attention_backend": llm.llm_engine.executor.attn_backend.name,
            "greedy": True,
            "ignore_eos": True,
        },
        "prompts": prompt_info,
        "timed_run": {
            "wall_s": run["wall_s"],
            "num_steps": len(steps),
            "output_tokens": run["output_tokens"],
            "stepstats_sums_s": {
                "wall": sum(s.wall_time_s for s in steps),
                "schedule": sum(s.schedule_time_s for s in steps),
                "model": sum(s.model_time_s for s in steps),
                "sample": sum(s.sample_time_s for s in steps),
            },
            "wrapper_seconds": run["timers"],
            "wrapper_calls": run["calls"],
            "breakdown": rows,
            "steps": [s.to_dict() for s in steps],
        },
        "torch_profiler": tprof,
        "cprofile": cprof,
        "cprofile_file": str(prof_path) if prof_path else None,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {out}" + (f" and {prof_path}" if prof_path else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

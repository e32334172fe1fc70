"""Serving overhead: ``workbench serve`` + ``workbench bench serve`` against offline ``LLM.generate``
on the same prompts, in one run (issue 16).

Both sides get the same engine arguments (``--dtype``, ``--max-model-len``, ``--max-num-seqs``,
``--max-num-batched-tokens``), the same torch thread count (``--threads``: ``torch.set_num_threads``
here, ``OMP_NUM_THREADS`` in the server's environment) and the same prompt *texts*, built once with
:func:`workbench.bench.samples.build_samples` (``--dataset-name random``: random token ids of exactly
``--input-len`` tokens, as ``bench serve --dataset-name random``; or ``jsonl``), which each side turns
into token ids with the same ``LLMEngine.tokenize``. Every request is greedy, ``ignore_eos``, with a
fixed output length, so both sides compute exactly the same tokens.

Two measurements per side:

* **Throughput** (``--num-prompts`` x ``--max-tokens``): offline, ``LLM.generate(prompts,
  SamplingParams(max_tokens=L, ignore_eos=True, temperature=0))``, output tok/s = output tokens /
  wall time of the call; server, ``run_bench_serve(request_rate=inf)`` (all requests at once over
  streaming ``/v1/completions``, no concurrency cap, so up to ``max_num_seqs`` run together),
  ``output_throughput`` = output tokens / benchmark duration (first send to last ``[DONE]``).
* **TTFT at one request at a time** (the first ``--ttft-prompts`` prompts, ``--ttft-max-tokens``
  tokens each): server, ``run_bench_serve(max_concurrency=1)``: client send -> first SSE chunk with
  text, on the client's clock. Offline, ``LLM.generate([prompt])`` per prompt, and the engine's own
  ``RequestOutput.metrics["ttft_s"]`` = ``first_token_time - arrival_time`` (arrival = when
  ``generate`` queued the request, after tokenizing; first token = when the step that sampled it
  ended). ``LLM.generate`` does not stream, so this is what a caller of the offline engine waits for
  its first token, less tokenization (a few hundred microseconds for these prompts). The script also
  records ``caller_ttft`` = the wall time of ``LLM.generate([prompt], max_tokens=1)`` (tokenize, add,
  one prefill step, detokenize, return), and the server engine's own TTFT (its
  ``vllm:time_to_first_token_seconds`` histogram, read from ``/metrics`` before and after), which
  splits the client's TTFT into engine time and HTTP/async time.

The server is started once (``python -m workbench.cli serve`` on 127.0.0.1, a free port), waited for
on ``GET /health``, warmed up, and stopped by PID at the end (SIGTERM, then SIGKILL). The offline
``LLM`` lives in this process; while one side runs, the other is idle. After one warm-up per side,
``--repeats`` rounds run interleaved (offline, server, offline, server, ...); the table reports
medians with min-max, and the ratios from the medians. Example::

    python benchmarks/serve_overhead.py                   # 64 prompts x 128 -> 64 tokens; TTFT on 16; 3 rounds
    python benchmarks/serve_overhead.py --num-prompts 4 --max-tokens 8 --ttft-prompts 2 --repeats 1  # smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import statistics
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from offline_throughput import machine_info  # noqa: E402

from workbench.server.launcher import ServerProcess  # noqa: E402

DEFAULT_OUT = REPO / "runs" / "bench" / "serve_overhead.json"
DEFAULT_JSONL = REPO / "datasets" / "default_prompts.jsonl"
SERVED_NAME = "bench-model"


# --------------------------------------------------------------------------- server process
def server_process(engine_args: dict, threads: int, port: int, log_path: Path) -> ServerProcess:
    """``workbench serve`` with the offline side's engine arguments and torch thread count."""
    return ServerProcess(
        port=port or None,
        threads=threads,
        startup_timeout=600,
        stop_timeout=30,
        env={"PYTHONPATH": str(REPO) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")},
        extra_args=["--served-model-name", SERVED_NAME, "--log-level", "warning"],
        log_path=log_path,
        **engine_args,
    )


def scrape(base: str) -> dict[str, float]:
    """The unlabelled-sum values of ``/metrics`` we use (Prometheus text: ``name{labels} value``)."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    want = (
        "vllm:time_to_first_token_seconds_sum",
        "vllm:time_to_first_token_seconds_count",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_queue_time_seconds_sum",
        "vllm:request_prefill_time_seconds_sum",
    )
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:]+)(?:\{[^}]*\})?\s+(\S+)$", line)
        if m and m.group(1) in want:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def delta(after: dict, before: dict) -> dict:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


# --------------------------------------------------------------------------- the two sides
def offline_throughput(llm, texts: list[str], max_tokens: int) -> dict:
    from workbench import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    gc.collect()
    t0 = time.perf_counter()
    outs = llm.generate(texts, sp)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "wall_s": wall,
        "output_tokens": n_out,
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "output_throughput": n_out / wall,
        "errors": [o.error for o in outs if o.error],
        "texts": [o.outputs[0].text for o in outs],
    }


def offline_ttft(llm, texts: list[str], max_tokens: int) -> dict:
    from workbench import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    gc.collect()
    engine, caller, e2e = [], [], []
    for t in texts:  # one request at a time, the same length as the server's
        (o,) = llm.generate([t], sp)
        engine.append(o.metrics["ttft_s"])
        e2e.append(o.metrics["e2e_s"])
    for t in texts:  # the caller's wait for a 1-token generate
        t0 = time.perf_counter()
        llm.generate([t], one)
        caller.append(time.perf_counter() - t0)
    return {"ttft_s": engine, "caller_ttft_s": caller, "e2e_s": e2e}


def server_throughput(base: str, samples) -> dict:
    from workbench.bench.serve import run_bench_serve

    gc.collect()
    before = scrape(base)
    r = run_bench_serve(
        base_url=base,
        model=SERVED_NAME,
        samples=samples,
        request_rate=math.inf,
        max_concurrency=None,
        ignore_eos=True,
        temperature=0.0,
        save_detailed=True,
        disable_tqdm=True,
        print_result=False,
        percentile_metrics="ttft,tpot,itl,e2el",
    )
    m = delta(scrape(base), before)
    return {
        "duration_s": r["duration"],
        "output_tokens": r["total_output_tokens"],
        "output_throughput": r["output_throughput"],
        "completed": r["completed"],
        "failed": r["failed"],
        "errors": [e for e in r["errors"] if e][:5],
        "max_concurrent_requests": r["max_concurrent_requests"],
        "server_prompt_tokens": m.get("vllm:prompt_tokens_total"),
        "server_generation_tokens": m.get("vllm:generation_tokens_total"),
        "median_ttft_ms": r["median_ttft_ms"],
        "median_tpot_ms": r["median_tpot_ms"],
        "texts": r["generated_texts"],
    }


def server_ttft(base: str, samples) -> dict:
    from workbench.bench.serve import run_bench_serve

    gc.collect()
    before = scrape(base)
    r = run_bench_serve(
        base_url=base,
        model=SERVED_NAME,
        samples=samples,
        request_rate=math.inf,
        max_concurrency=1,
        ignore_eos=True,
        temperature=0.0,
        save_detailed=True,
        disable_tqdm=True,
        print_result=False,
        percentile_metrics="ttft,tpot,itl,e2el",
    )
    m = delta(scrape(base), before)
    n = m.get("vllm:time_to_first_token_seconds_count") or 0
    return {
        "ttft_s": r["ttfts"],
        "e2e_s": r["latencies"],
        "max_concurrent_requests": r["max_concurrent_requests"],
        "failed": r["failed"],
        "errors": [e for e in r["errors"] if e][:5],
        "median_tpot_ms": r["median_tpot_ms"],
        # the server engine's own TTFT (arrival in the engine -> first token), mean over the phase
        "engine_ttft_mean_s": (m["vllm:time_to_first_token_seconds_sum"] / n) if n else None,
        "engine_ttft_count": n,
    }


# --------------------------------------------------------------------------- reporting
def med_range(xs: list[float], scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    xs = [x * scale for x in xs if x is not None]
    if not xs:
        return "n/a"
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64, help="throughput: requests (default 64)")
    p.add_argument("--max-tokens", type=int, default=64, help="throughput: output tokens per request (default 64)")
    p.add_argument(
        "--dataset-name", choices=("random", "jsonl"), default="random", help="prompts (default random, as bench serve)"
    )
    p.add_argument("--dataset-path", default=str(DEFAULT_JSONL), help="jsonl: prompt file (default the project's)")
    p.add_argument("--input-len", type=int, default=128, help="random: prompt tokens (default 128)")
    p.add_argument("--seed", type=int, default=0, help="seeds the random prompts (default 0)")
    p.add_argument("--ttft-prompts", type=int, default=16, help="TTFT: requests sent one at a time (default 16)")
    p.add_argument("--ttft-max-tokens", type=int, default=16, help="TTFT: output tokens per request (default 16)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds after one warm-up (default 3)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads on both sides (default: this process's torch default, honouring OMP_NUM_THREADS)",
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    p.add_argument("--server-log", default=str(REPO / "runs" / "bench" / "serve_overhead_server.log"))
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"JSON output (default {DEFAULT_OUT.relative_to(REPO)})")
    args = p.parse_args(argv)
    for name in ("num_prompts", "max_tokens", "input_len", "ttft_prompts", "ttft_max_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    machine = machine_info()
    print(
        f"# {machine['cpu_model']} | {machine['cpus_available']} CPUs | torch {machine['torch']} "
        f"({threads} threads, both sides) | load average {machine['loadavg_1m_at_start']:.2f}",
        flush=True,
    )
    engine_args = {
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }

    from workbench import LLM
    from workbench.bench.samples import build_samples, load_tokenizer

    tok, _ = load_tokenizer(None)
    samples = build_samples(
        args.dataset_name,
        tok,
        num_prompts=args.num_prompts,
        seed=args.seed,
        dataset_path=args.dataset_path if args.dataset_name == "jsonl" else None,
        output_len=args.max_tokens,
        random_input_len=args.input_len,
        random_output_len=args.max_tokens,
    )
    if any(not isinstance(s.prompt, str) for s in samples):
        raise SystemExit("the prompts must be text (chat messages need the chat endpoint)")
    texts = [s.prompt for s in samples]
    ttft_samples = [
        type(s)(s.prompt, s.prompt_len, args.ttft_max_tokens, s.request_id) for s in samples[: args.ttft_prompts]
    ]
    ttft_texts = [s.prompt for s in ttft_samples]
    warm = [type(s)(s.prompt, s.prompt_len, 8, s.request_id) for s in samples[:4]]

    srv = server_process(engine_args, threads, args.port, Path(args.server_log))
    base = srv.base_url
    t_start = time.perf_counter()
    srv.launch()
    print(f"# server: pid {srv.pid}, {' '.join(srv.args[1:])}", flush=True)
    offline_runs: list[dict] = []
    server_runs: list[dict] = []
    try:
        llm = LLM(**engine_args)  # loads while the server loads
        health_s = srv.wait_ready()
        print(f"# server healthy after {time.perf_counter() - t_start:.1f}s (waited {health_s:.1f}s here)", flush=True)
        prompt_ids = [len(p) for p in (llm.llm_engine.tokenize(t)[0] for t in texts)]

        # warm-up: both sides, a short batch and a single request
        from workbench.bench.serve import run_bench_serve

        t0 = time.perf_counter()
        offline_throughput(llm, [w.prompt for w in warm], 8)
        offline_ttft(llm, [warm[0].prompt], 4)
        warm_off = time.perf_counter() - t0
        t0 = time.perf_counter()
        for conc in (None, 1):
            run_bench_serve(
                base_url=base,
                model=SERVED_NAME,
                samples=warm,
                max_concurrency=conc,
                ignore_eos=True,
                temperature=0.0,
                disable_tqdm=True,
                print_result=False,
            )
        warm_srv = time.perf_counter() - t0
        print(f"# warm-up: offline {warm_off:.2f}s, server {warm_srv:.2f}s", flush=True)

        for rep in range(args.repeats):
            o = offline_throughput(llm, texts, args.max_tokens)
            o.update({f"ttft_{k}": v for k, v in offline_ttft(llm, ttft_texts, args.ttft_max_tokens).items()})
            o["loadavg_1m"] = os.getloadavg()[0]
            offline_runs.append(o)
            print(
                f"# round {rep + 1}/{args.repeats} offline: {o['wall_s']:.2f}s, {o['output_throughput']:.1f} tok/s; "
                f"TTFT median {median(o['ttft_ttft_s']) * 1e3:.1f} ms (caller, 1 token: "
                f"{median(o['ttft_caller_ttft_s']) * 1e3:.1f} ms)",
                flush=True,
            )
            s = server_throughput(base, samples)
            s.update({f"ttft_{k}": v for k, v in server_ttft(base, ttft_samples).items()})
            s["loadavg_1m"] = os.getloadavg()[0]
            server_runs.append(s)
            eng_ttft = s["ttft_engine_ttft_mean_s"]
            print(
                f"# round {rep + 1}/{args.repeats} server:  {s['duration_s']:.2f}s, {s['output_throughput']:.1f} tok/s "
                f"({s['completed']} ok, {s['failed']} failed, peak {s['max_concurrent_requests']} in flight); "
                f"TTFT median {median(s['ttft_ttft_s']) * 1e3:.1f} ms (server engine mean "
                f"{'n/a' if eng_ttft is None else f'{eng_ttft * 1e3:.1f}'} ms)",
                flush=True,
            )
    finally:
        rc = srv.stop()
        print(f"# server stopped (exit code {rc})", flush=True)

    # ---------------------------------------------------------------- summary
    off_tp = [r["output_throughput"] for r in offline_runs]
    srv_tp = [r["output_throughput"] for r in server_runs]
    off_ttft = [median(r["ttft_ttft_s"]) for r in offline_runs]
    off_caller = [median(r["ttft_caller_ttft_s"]) for r in offline_runs]
    srv_ttft = [median(r["ttft_ttft_s"]) for r in server_runs]
    srv_eng = [r["ttft_engine_ttft_mean_s"] for r in server_runs]
    pair_ratio = [s / o for s, o in zip(srv_tp, off_tp)]
    pair_diff = [(s - o) * 1e3 for s, o in zip(srv_ttft, off_ttft)]
    summary = {
        "offline_output_throughput": median(off_tp),
        "server_output_throughput": median(srv_tp),
        "throughput_ratio_of_medians": median(srv_tp) / median(off_tp),
        "throughput_ratio_per_round": pair_ratio,
        "offline_ttft_ms": median(off_ttft) * 1e3,
        "offline_caller_ttft_ms": median(off_caller) * 1e3,
        "server_ttft_ms": median(srv_ttft) * 1e3,
        "server_engine_ttft_ms": (median(srv_eng) or 0) * 1e3 if any(x is not None for x in srv_eng) else None,
        "ttft_diff_ms_of_medians": (median(srv_ttft) - median(off_ttft)) * 1e3,
        "ttft_diff_ms_per_round": pair_diff,
        "target_throughput_90pct_met": median(srv_tp) / median(off_tp) >= 0.9,
        "target_ttft_10ms_met": (median(srv_ttft) - median(off_ttft)) * 1e3 <= 10,
    }
    expected = len(texts) * args.max_tokens
    checks = {
        "offline_output_tokens": [r["output_tokens"] for r in offline_runs],
        "server_output_tokens": [r["output_tokens"] for r in server_runs],
        "expected_output_tokens": expected,
        "offline_prompt_tokens": offline_runs[0]["prompt_tokens"] if offline_runs else None,
        "server_prompt_tokens_from_metrics": [r["server_prompt_tokens"] for r in server_runs],
        "same_text_outputs_round1": (
            sum(a == b for a, b in zip(offline_runs[0]["texts"], server_runs[0]["texts"])) if server_runs else None
        ),
    }

    L, n = args.max_tokens, len(texts)
    print()
    print(
        f"Serving overhead: {n} prompts ({args.dataset_name}, {sum(prompt_ids)} prompt tokens) x {L} output tokens, "
        f"greedy, EOS ignored, {args.dtype}, {threads} torch threads on both sides; TTFT: {len(ttft_texts)} prompts "
        f"one at a time x {args.ttft_max_tokens} tokens; median (min–max) of {len(offline_runs)} interleaved rounds"
    )
    print()
    print("| measure | offline `LLM.generate` | `workbench serve` + `bench serve` | server vs offline |")
    print("|---|---:|---:|---:|")
    print(
        f"| output tok/s, all at once (request rate inf) | {med_range(off_tp)} | {med_range(srv_tp)} | "
        f"{summary['throughput_ratio_of_medians']:.1%} (rounds {', '.join(f'{x:.1%}' for x in pair_ratio)}) |"
    )
    print(
        f"| TTFT median, one request at a time (ms) | {med_range(off_ttft, 1e3)} | {med_range(srv_ttft, 1e3)} | "
        f"{summary['ttft_diff_ms_of_medians']:+.1f} ms (rounds {', '.join(f'{x:+.1f}' for x in pair_diff)}) |"
    )
    print(
        f"| TTFT, other views (ms) | caller of a 1-token generate: {med_range(off_caller, 1e3)} | "
        f"server engine's own (mean): {med_range(srv_eng, 1e3)} | |"
    )
    print()
    print(
        f"targets: server throughput >= 90% of offline: {'met' if summary['target_throughput_90pct_met'] else 'NOT met'}"
        f"; TTFT within 10 ms: {'met' if summary['target_ttft_10ms_met'] else 'NOT met'}"
    )
    print(
        f"checks: output tokens offline {checks['offline_output_tokens']}, server {checks['server_output_tokens']} "
        f"(expected {expected}); prompt tokens offline {checks['offline_prompt_tokens']}, server "
        f"{checks['server_prompt_tokens_from_metrics']}; round-1 texts equal {checks['same_text_outputs_round1']}/{n}"
    )

    strip = {"texts"}
    report = {
        "benchmark": "serve_overhead",
        "command": " ".join(["python", "benchmarks/serve_overhead.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine,
        "settings": {
            "engine_args": engine_args,
            "torch_num_threads_both_sides": threads,
            "server_env_OMP_NUM_THREADS": threads,
            "server_command": srv.args,
            "dataset_name": args.dataset_name,
            "dataset_path": args.dataset_path if args.dataset_name == "jsonl" else None,
            "input_len": args.input_len if args.dataset_name == "random" else None,
            "num_prompts": n,
            "max_tokens": L,
            "ttft_prompts": len(ttft_texts),
            "ttft_max_tokens": args.ttft_max_tokens,
            "repeats": args.repeats,
            "order": "one warm-up per side, then rounds: offline (throughput, TTFT), server (throughput, TTFT)",
            "ttft_definitions": {
                "offline": "RequestOutput.metrics['ttft_s'] = first_token_time - arrival_time (engine clock)",
                "offline_caller": "wall time of LLM.generate([prompt], max_tokens=1)",
                "server": "client: send -> first SSE chunk with text (bench serve)",
                "server_engine": "mean of the server's vllm:time_to_first_token_seconds over the phase",
            },
        },
        "prompt_tokens": prompt_ids,
        "summary": summary,
        "checks": checks,
        "offline_runs": [{k: v for k, v in r.items() if k not in strip} for r in offline_runs],
        "server_runs": [{k: v for k, v in r.items() if k not in strip} for r in server_runs],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

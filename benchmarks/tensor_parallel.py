"""Tensor parallelism on this machine: step time split into compute and communication, and the
NCCL buffer memory the model predicts.

Part 1 — for each (model, tensor_parallel_size): one ``LLM`` (worker processes over gloo, CPU,
float32), a warm-up, then ``--repeats`` timed ``generate`` calls of the same greedy batch
(``--num-prompts`` prompts of ``offline_throughput.py``'s set, cut to ``--max-prompt-len`` tokens,
``--max-tokens`` tokens each, EOS ignored). Every step's ``StepStats`` gives its wall time, the
model time (input preparation + forward on rank 0, waiting for the other ranks included) and
``comm_time_s`` — seconds rank 0 spent in collectives (all-reduces, the logits' all-gather, the
broadcast of the step's inputs). Compute = model time - communication. Each figure is the median
over the repeats of its sum over the run's steps.

Models: the bundled SmolLM2-135M-Instruct (9 heads, 3 KV heads: TP 1 and 3 only) and a
random-weight Llama of the same size whose heads divide by 2 and 3 (``--shape-heads`` 12 heads,
6 KV heads, head_dim 48; hidden 576, 30 layers, MLP 1536, vocab 49,152), so that TP 1/2/3 run on
one model. Outputs of every TP are checked equal to TP=1's (greedy token ids).

Part 2 — :func:`workbench.comm.nccl_buffer_bytes` for TP 2/4/8 at NCCL_BUFFSIZE 4 MiB (default)
and a tuned value, for 2 and 16 channels (formula and sources in :mod:`workbench.comm`).

    python benchmarks/tensor_parallel.py                         # 8 prompts x 32 tokens, 3 repeats
    python benchmarks/tensor_parallel.py --num-prompts 2 --max-tokens 4 --repeats 1   # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from offline_throughput import REPO, load_token_prompts, machine_info  # same folder

DEFAULT_OUT = REPO / "runs" / "bench" / "tensor_parallel.json"


def make_shape_model(folder: Path, heads: int, kv_heads: int) -> Path:
    """A random-weight Llama the size of SmolLM2-135M whose head counts divide by 2 and 3."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).eval().save_pretrained(str(folder), safe_serialization=True)
    return folder


def run_one(model: str | None, tp: int, prompts: list[list[int]], max_tokens: int, repeats: int) -> dict:
    from workbench import LLM, SamplingParams

    kw = {} if model is None else {"model": model}
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    llm = LLM(
        tensor_parallel_size=tp,
        dtype="float32",
        max_model_len=1024,
        num_gpu_blocks_override=1024,
        max_num_seqs=64,
        **kw,
    )
    startup = time.perf_counter() - t0
    try:
        eng = llm.llm_engine
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
        runs, outputs = [], None
        for _ in range(repeats):
            first = len(eng.recorder.steps)
            t = time.perf_counter()
            outs = llm.generate(prompts, sp)
            elapsed = time.perf_counter() - t
            steps = eng.recorder.steps[first:]
            outputs = [o.outputs[0].token_ids for o in outs]
            model_s = sum(s.model_time_s for s in steps)
            comm_s = sum(s.comm_time_s for s in steps)
            runs.append(
                dict(
                    generate_s=elapsed,
                    steps=len(steps),
                    step_s=sum(s.wall_time_s for s in steps),
                    model_s=model_s,
                    comm_s=comm_s,
                    compute_s=model_s - comm_s,
                    allreduce_bytes=sum(s.allreduce_bytes for s in steps),
                    allgather_bytes=sum(s.allgather_bytes for s in steps),
                    broadcast_bytes=sum(s.broadcast_bytes for s in steps),
                    collectives=sum(s.num_collectives for s in steps),
                )
            )
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        return dict(
            model=model or "smollm2-135m",
            tensor_parallel_size=tp,
            startup_s=startup,
            torch_threads_rank0=torch.get_num_threads(),
            comm_buffer_bytes=eng.memory.comm_buffer_bytes,
            kv_bytes_per_token_per_rank=eng.memory.kv_bytes_per_token,
            weights_bytes_per_rank=eng.memory.weights_bytes,
            runs=runs,
            median=med,
            outputs=outputs,
        )
    finally:
        llm.shutdown()


def nccl_table(tuned: int) -> list[dict]:
    from workbench.comm import NCCL_DEFAULT_BUFFSIZE, nccl_buffer_bytes

    rows = []
    for tp in (2, 4, 8):
        for ch in (2, 16):
            for buf in (NCCL_DEFAULT_BUFFSIZE, tuned):
                e = nccl_buffer_bytes(tp, buffsize=buf, nchannels=ch)
                s = nccl_buffer_bytes(tp, buffsize=buf, nchannels=ch, protocols="Simple")
                rows.append(
                    dict(
                        tensor_parallel_size=tp,
                        nchannels=ch,
                        nccl_buffsize=buf,
                        per_rank_bytes=e.per_rank_bytes,
                        group_bytes=e.total_bytes,
                        per_rank_simple_only_bytes=s.per_rank_bytes,
                    )
                )
    return rows


def markdown(results: list[dict], table: list[dict]) -> str:
    mib = 2**20
    out = [
        "| model | TP | torch threads per rank | steps | step time (s) | model (s) | compute (s) | communication (s) | comm share of model | "
        "all-reduced (MiB) | collectives | same tokens as TP=1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        m = r["median"]
        out.append(
            f"| {r['label']} | {r['tensor_parallel_size']} | {r['torch_threads_rank0']} | {m['steps']:.0f} | {m['step_s']:.2f} | {m['model_s']:.2f} | "
            f"{m['compute_s']:.2f} | {m['comm_s']:.2f} | {m['comm_s'] / m['model_s']:.0%} | "
            f"{m['allreduce_bytes'] / mib:.1f} | {m['collectives']:.0f} | {r['same_as_tp1']} |"
        )
    out += [
        "",
        "| TP | channels | NCCL_BUFFSIZE | per rank, LL+LL128+Simple (MiB) | per rank, Simple only (MiB) | "
        "whole group (MiB) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for t in table:
        out.append(
            f"| {t['tensor_parallel_size']} | {t['nchannels']} | {t['nccl_buffsize'] / mib:g} MiB | "
            f"{t['per_rank_bytes'] / mib:.2f} | {t['per_rank_simple_only_bytes'] / mib:.2f} | "
            f"{t['group_bytes'] / mib:.2f} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bundled-tp", default="1,3", help="TP sizes for the bundled model ('' = skip)")
    ap.add_argument("--shape-tp", default="1,2,3", help="TP sizes for the random model of the same size ('' = skip)")
    ap.add_argument("--shape-heads", default="12,6", help="heads,KV heads of the random model")
    ap.add_argument("--tp1-threads", type=int, default=None, help="torch threads for TP=1 runs (default: torch's)")
    ap.add_argument("--tuned-buffsize", type=int, default=1 << 20, help="the tuned NCCL_BUFFSIZE of part 2 (bytes)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)

    import os

    from workbench.model.loader import _load_tokenizer, load_model

    load1 = os.getloadavg()[0]
    if load1 > 0.5:
        print(f"warning: 1-minute load average {load1:.2f}: other processes share the CPU", file=sys.stderr)
    from workbench.config import EngineConfig

    cfg = EngineConfig()
    folder = load_model(cfg.model, cfg.resolved_cache_dir).folder
    prompts, source = load_token_prompts(_load_tokenizer(folder), args.num_prompts, args.max_prompt_len)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        plans = [(None, int(t), "SmolLM2-135M (9 heads, 3 KV)") for t in args.bundled_tp.split(",") if t]
        if args.shape_tp:
            heads, kv = (int(x) for x in args.shape_heads.split(","))
            shape = str(make_shape_model(Path(tmp) / "shape", heads, kv))
            plans += [(shape, int(t), f"random, 135M shape ({heads} heads, {kv} KV)") for t in args.shape_tp.split(",")]
        ref: dict[str | None, list] = {}
        for model, tp, label in plans:
            print(f"{label}: TP={tp} ...", file=sys.stderr, flush=True)
            if tp == 1 and args.tp1_threads:
                torch.set_num_threads(args.tp1_threads)
            r = run_one(model, tp, prompts, args.max_tokens, args.repeats)
            r["label"] = label
            if tp == 1:
                ref[model] = r["outputs"]
            r["same_as_tp1"] = "yes" if ref.get(model) == r["outputs"] else ("no" if model in ref else "n/a")
            if model is not None:
                r["model"] = label
            results.append(r)
    table = nccl_table(args.tuned_buffsize)
    report = dict(
        command=" ".join(["python", "benchmarks/tensor_parallel.py", *(argv if argv is not None else sys.argv[1:])]),
        machine=machine_info(),
        load_average_1min_at_start=load1,
        prompts=dict(source=source, count=len(prompts), tokens=sum(map(len, prompts))),
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        results=[{k: v for k, v in r.items() if k != "outputs"} for r in results],
        nccl_buffers=table,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(markdown(results, table))
    print(f"\nwritten: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Reproduce the vLLM paper's Fig. 2 / Fig. 13 comparison on this machine, and static vs grouped
vs continuous batching.

Part ``allocators``: real prompts (ShareGPT from shared/data beside the checkout when present, else the project's
own prompts), each replayed at a true output length (``--true-output-lens``: by default seeded,
long-tailed, exponential of mean 64 tokens; ``model`` = the model's own, measured by a paged run)
under a cap well above them (``--max-tokens`` 512), a KV pool small enough that memory binds. Each
request ends at its true length as if its model had emitted EOS; orca-max reserves prompt + cap,
orca-pow2 the power of two of the true length, orca-oracle the true length — the vLLM paper's Fig. 2
order (static < orca-max < orca-pow2 < orca-oracle < paged). For each allocator: the share of
occupied KV memory holding token states (Fig. 2's measure), the share of the pool, and the mean
number of requests batched per step (Fig. 13's measure). Memory figures and batch sizes count steps, not seconds, so one run each
is exact; the throughput column is one run and only indicative.

Part ``batching``: 16 requests whose prompts are spread from 128 to 2,048 tokens (shuffled
arrival order, seeded), greedy, ``max_tokens`` 64, ``max_num_seqs`` 4, through continuous,
static and grouped batching with the paged allocator; median of ``--repeats`` runs of wall time,
throughput, TTFT and end-to-end latency, and the ratio to continuous batching in the same run.

    python benchmarks/fragmentation.py allocators                      # ShareGPT when present
    python benchmarks/fragmentation.py allocators --dataset default    # the project's own prompts
    python benchmarks/fragmentation.py allocators --allocators paged,orca-max,best-fit,buddy
    python benchmarks/fragmentation.py batching --repeats 3
    python benchmarks/fragmentation.py summarize runs/compare-<time>   # the table of a compare folder
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import sys
import tempfile
from pathlib import Path

import click
import torch

REPO = Path(__file__).resolve().parents[1]
SHAREGPT = REPO.parent / "shared" / "data" / "sharegpt" / "ShareGPT_V3_filtered_500.json"

# the paper's Orca (Max) reserves the model's maximum length (2,048 tokens): our ``static`` (as in chapter 2);
# our ``orca-max`` (prompt + the request's cap) has no column of its own there
PAPER_FIG2 = {"static": 0.204, "orca-pow2": 0.268, "orca-oracle": 0.382, "paged": 0.963}  # token states
PAPER_FIG13 = {"static": 7.00, "orca-pow2": 9.81, "orca-oracle": 13.62, "paged": 30.42}  # batched requests


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


@click.group()
def cli():
    """Fragmentation and batching reproductions (results as JSON + a markdown table)."""


@cli.command()
@click.option("--num-prompts", default=32, show_default=True)
@click.option("--max-tokens", default=512, show_default=True, help="every request's cap (orca-max reserves by it)")
@click.option(
    "--true-output-lens",
    default="exponential:64",
    show_default=True,
    help="model | trace | exponential:M | auto (workbench.bench.output_lens)",
)
@click.option(
    "--dataset",
    "dataset_opt",
    default="auto",
    show_default=True,
    help="auto (ShareGPT when present) | default | a path",
)
@click.option("--max-model-len", default=1024, show_default=True)
@click.option("--kv-pool-tokens", default=4096, show_default=True, help="KV pool size in tokens")
@click.option("--max-num-seqs", default=64, show_default=True)
@click.option("--out", default="runs/bench-fragmentation.json", show_default=True)
@click.option(
    "--allocators",
    "names",
    default="paged,static,orca-max,orca-pow2,orca-oracle",
    show_default=True,
    help="comma-separated kv_allocator values (built-in, e.g. best-fit and buddy, or package.module:Class); "
    "paged among them",
)
def allocators(
    num_prompts, max_tokens, true_output_lens, dataset_opt, max_model_len, kv_pool_tokens, max_num_seqs, out, names
):
    """Paged vs contiguous allocators on real prompts (default: paged and the four contiguous baselines)."""
    from workbench.bench.compare import compare

    names = [a.strip() for a in names.split(",") if a.strip()]
    if "paged" not in names:
        raise click.BadParameter(f"{','.join(names)!r}: include paged (the table's reference row)")
    if dataset_opt == "auto":
        dataset = str(SHAREGPT) if SHAREGPT.exists() else None
    else:
        dataset = None if dataset_opt == "default" else dataset_opt
    res = compare(
        allocators=names,
        dataset=dataset,
        num_prompts=num_prompts,
        max_tokens=max_tokens,
        true_output_lens=true_output_lens,
        output_dir="runs",
        progress=False,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        num_gpu_blocks_override=kv_pool_tokens // 16,
        block_size=16,
    )
    lens = [len(o.outputs[0].token_ids) for o in res.results["paged"].outputs]
    result = {
        "machine": machine(),
        "dataset": dataset or "datasets/default_prompts.jsonl",
        "num_prompts": num_prompts,
        "max_tokens": max_tokens,
        "true_output_lens": true_output_lens,
        "max_model_len": max_model_len,
        "kv_pool_tokens": kv_pool_tokens,
        "output_len_mean": statistics.mean(lens),
        "output_len_median": statistics.median(lens),
        "prompt_len_mean": statistics.mean(r.prompt_tokens for r in res.results["paged"].recorder.requests),
        "rows": res.rows,
        "report": str(res.out_dir / "compare.html"),
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
    print_table(res.out_dir)


def memory_bound_figures(steps: list[dict]) -> dict:
    """Requests batched and token states / used over the steps where requests were waiting
    (the memory-bound part of an offline run; the drain at the end is excluded)."""
    w = [x for x in steps if x["num_waiting"] > 0]
    used = sum(x["num_blocks"] * x["block_size"] - x["free"] for x in w)
    return {
        "steps_waiting": len(w),
        "batched_while_waiting": sum(x["num_prefill_reqs"] + x["num_decode_reqs"] for x in w) / max(1, len(w)),
        "token_states_used_while_waiting": sum(x["token_states"] for x in w) / used if used else 0.0,
    }


def print_table(folder: Path) -> None:
    """The markdown table of a ``workbench compare`` folder, beside the paper's figures."""
    folder = Path(folder)
    rows = json.loads((folder / "compare.json").read_text())
    print(
        "| allocator | token states / used | token states / pool | reservation / used | internal / used "
        "| external / used | requests batched | batched while requests wait | token states / used while requests "
        "wait | output tok/s | paper Fig. 2 token states | paper Fig. 13 batched |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        a = r["kv_allocator"]
        steps = [json.loads(x) for x in (folder / r["variant"].replace(" / ", "_") / "steps.jsonl").open()]
        m = memory_bound_figures(steps)
        fig2 = f"{PAPER_FIG2[a]:.1%}" if a in PAPER_FIG2 else "—"
        fig13 = f"{PAPER_FIG13[a]:.2f}" if a in PAPER_FIG13 else "—"
        print(
            f"| {a} | {r['token_states_used_frac']:.1%} | {r['token_states_pool_frac']:.1%} "
            f"| {r['reservation_used_frac']:.1%} | {r['internal_fragmentation_used_frac']:.1%} "
            f"| {r['external_fragmentation_used_frac']:.1%} | {r['batched_reqs_mean']:.2f} "
            f"| {m['batched_while_waiting']:.2f} | {m['token_states_used_while_waiting']:.1%} "
            f"| {r['output_throughput_tok_s']:.1f} | {fig2} | {fig13} |"
        )


@cli.command()
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
def summarize(folder):
    """Print the table of an existing ``workbench compare`` folder."""
    print_table(Path(folder))


def spread_prompts(tok, n: int, lo: int, hi: int, seed: int) -> list[dict]:
    """``n`` plain-text prompts of about ``lo .. hi`` tokens (evenly spread), shuffled, from real text."""
    from workbench.bench.datasets import default_prompts, load_prompts

    recs = load_prompts(SHAREGPT) if SHAREGPT.exists() else default_prompts()
    text = "\n\n".join(r.prompt if isinstance(r.prompt, str) else r.prompt[0]["content"] for r in recs)
    ids = tok.encode(text, add_special_tokens=False)
    targets = [round(lo + (hi - lo) * i / (n - 1)) for i in range(n)]
    rng = random.Random(seed)
    rng.shuffle(targets)
    out = []
    start = 0
    for i, t in enumerate(targets):
        out.append({"id": f"spread-{i}", "prompt": tok.decode(ids[start : start + t]), "chat": False})
        start += t
    return out


@cli.command()
@click.option("--repeats", default=3, show_default=True)
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--max-num-seqs", default=4, show_default=True)
@click.option("--out", default="runs/bench-batching.json", show_default=True)
def batching(repeats, max_tokens, max_num_seqs, out):
    """Continuous vs static vs grouped batching on 16 prompts of 128..2,048 tokens."""
    from workbench.bench.run import run_job
    from workbench.entrypoints.llm import LLM

    with tempfile.TemporaryDirectory() as d:
        policies = ["continuous", "static", "grouped"]
        llms = {
            p: LLM(max_model_len=4096, max_num_seqs=max_num_seqs, batching_policy=p, num_gpu_blocks_override=1024)
            for p in policies
        }
        path = Path(d) / "spread.jsonl"
        prompts = spread_prompts(llms["continuous"].tokenizer, 16, 128, 2048, seed=0)
        path.write_text("".join(json.dumps(r) + "\n" for r in prompts))
        runs = {p: [] for p in policies}
        for _ in range(repeats):
            for p in policies:  # interleaved, so drifts in machine load hit every policy alike
                r = run_job(
                    dataset=path, num_prompts=None, max_tokens=max_tokens, output_dir=None, progress=False, llm=llms[p]
                )
                s = r.summary
                runs[p].append(
                    {
                        "wall_time_s": r.wall_time_s,
                        "output_throughput_tok_s": s["output_throughput_tok_s"],
                        "ttft_p50_s": s["ttft_p50_s"],
                        "e2e_p50_s": s["e2e_p50_s"],
                        "batched_reqs_mean": s["batched_reqs_mean"],
                        "num_steps": s["num_steps"],
                        "prompt_lens": sorted(q.prompt_tokens for q in r.recorder.requests),
                        "output_tokens_total": s["output_tokens_total"],
                    }
                )
    med = {p: {k: statistics.median(x[k] for x in v) for k in v[0] if k != "prompt_lens"} for p, v in runs.items()}
    result = {
        "machine": machine(),
        "repeats": repeats,
        "max_tokens": max_tokens,
        "max_num_seqs": max_num_seqs,
        "prompt_lens": runs["continuous"][0]["prompt_lens"],
        "median": med,
        "runs": runs,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    base = med["continuous"]
    print(
        "| policy | wall time (s) | output tok/s | vs continuous | TTFT p50 (s) | e2e p50 (s) | requests batched "
        "| steps |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for p, m in med.items():
        print(
            f"| {p} | {m['wall_time_s']:.1f} | {m['output_throughput_tok_s']:.1f} "
            f"| {m['output_throughput_tok_s'] / base['output_throughput_tok_s']:.2f}x | {m['ttft_p50_s']:.2f} "
            f"| {m['e2e_p50_s']:.2f} | {m['batched_reqs_mean']:.2f} | {m['num_steps']:.0f} |"
        )


if __name__ == "__main__":
    sys.exit(cli())

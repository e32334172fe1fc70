"""``workbench kv-calc`` (click) and its rich printer, over the calculator in :mod:`workbench.kvcalc`."""

from __future__ import annotations

import json
import sys

import click
import torch

from workbench.catalog import GPUS, MODELS
from workbench.cli.errors import user_errors
from workbench.kvcalc import KV_DTYPES, WEIGHT_DTYPES, KVCalcResult, fmt_bytes, kv_calc
from workbench.memory import kv_bytes_per_token


def _console():
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=160)  # pipes and tests: no wrapping of long lines


def print_catalog(console=None) -> None:
    """Print the model and GPU catalogues (computed sizes; sources)."""
    from rich.table import Table

    console = console or _console()
    t = Table(title="models (KV per token: float16, one GPU)")
    for col, just in [
        ("name", "left"),
        ("layers", "right"),
        ("hidden", "right"),
        ("heads q/kv", "right"),
        ("head_dim", "right"),
        ("params", "right"),
        ("KV B/token", "right"),
        ("max pos", "right"),
        ("source", "left"),
    ]:
        t.add_column(col, justify=just, overflow="fold")
    for m in MODELS.values():
        t.add_row(
            m.name,
            str(m.num_hidden_layers),
            f"{m.hidden_size:,}",
            f"{m.num_attention_heads}/{m.num_key_value_heads}",
            str(m.head_dim),
            f"{m.num_params() / 1e9:,.2f} B",
            f"{kv_bytes_per_token(m, torch.float16):,}",
            f"{m.max_position_embeddings:,}",
            m.source,
        )
    console.print(t)
    g = Table(title="GPUs (memory: the datasheet figure read as GiB)")
    for col in ("name", "memory (bytes)", "GiB", "datasheet", "source"):
        g.add_column(col, justify="right" if col in ("memory (bytes)", "GiB") else "left", overflow="fold")
    for x in GPUS.values():
        g.add_row(x.name, f"{x.memory_bytes:,}", f"{x.memory_bytes / (1 << 30):,.0f}", x.datasheet, x.source)
    console.print(g)
    console.print(
        "MODEL may also be a Hugging Face repository id that an entry cites (meta-llama/Llama-2-70b-hf), a "
        "config.json, an HF model folder, a .gguf file, or 'bundled' (the bundled model's GGUF)",
        markup=False,
    )


def print_result(res: KVCalcResult, console=None) -> None:
    """Print a :class:`KVCalcResult` as a table, then the verdict, notes and suggestions."""
    from rich.table import Table

    console = console or _console()
    a = res.arch
    tp = res.tensor_parallel_size

    def b(n):
        return f"{n:,} B" if abs(n) < 1024 else f"{n:,} B ({fmt_bytes(n)})"

    if res.resolved:
        console.print(res.resolved, markup=False, soft_wrap=True)
    t = Table(title=f"workbench kv-calc: {a.name}", show_header=False)
    t.add_column("figure")
    t.add_column("value", overflow="fold")
    rows = [
        ("source", a.source),
        (
            "architecture",
            f"{a.num_hidden_layers} layers, hidden {a.hidden_size:,}, {a.num_attention_heads} q / "
            f"{a.num_key_value_heads} kv heads x {a.head_dim}, intermediate {a.intermediate_size:,}, "
            f"vocab {a.vocab_size:,}" + (", tied embeddings" if a.tie_word_embeddings else ""),
        ),
        ("parameters", f"{res.params_total:,} ({res.params_total / 1e9:,.2f} B); per GPU {res.params_per_gpu:,}"),
        ("dtypes", f"weights {res.dtype}, KV cache {res.kv_cache_dtype}"),
        ("tensor parallel", f"{tp} GPU{'s' if tp > 1 else ''}, {res.kv_heads_per_rank} KV heads per GPU"),
        ("KV per token, per GPU", b(res.kv_bytes_per_token)),
    ]
    if tp > 1:
        rows.append(("KV per token, all GPUs", b(res.kv_bytes_per_token_all_gpus)))
    rows.append((f"KV per block ({res.block_size} tokens)", b(res.block_bytes)))
    if res.seq_len:
        rows.append((f"KV per {res.seq_len:,}-token sequence", b(res.kv_bytes_per_seq)))
    rows.append(("weights per GPU", b(res.weights_bytes_per_gpu)))
    if res.gpu_memory_bytes is not None:
        gpu = f"{res.gpu.name}, {res.gpu.datasheet}: " if res.gpu else ""
        usable = int(res.gpu_memory_bytes * res.gpu_memory_utilization)
        rows += [
            ("GPU memory", f"{gpu}{b(res.gpu_memory_bytes)}"),
            (f"x gpu_memory_utilization {res.gpu_memory_utilization}", b(usable)),
            ("activation reserve", f"{b(res.activation_reserve_bytes)}  ({res.activation_reserve_how})"),
            ("KV budget per GPU", b(res.kv_budget_bytes)),
            ("KV blocks / tokens", f"{res.num_blocks:,} blocks / {res.kv_tokens:,} tokens"),
        ]
        if res.seq_len:
            rows.append(
                (
                    f"sequences of {res.seq_len:,} tokens",
                    f"{res.max_sequences:,} at once (max concurrency {res.max_concurrency:.2f}x)",
                )
            )
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    for n in res.notes:  # before the verdict: a note (e.g. seq_len past the model's positions) qualifies it
        console.print(f"note: {n}", markup=False, soft_wrap=True)
    style = "green" if res.fits else ("red" if res.fits is False else None)
    console.print(res.verdict(), style=style, markup=False, soft_wrap=True)
    for s in res.suggestions:
        console.print(f"  try {s}", markup=False, soft_wrap=True)
    if res.gpu_memory_bytes is not None:
        if res.activation_reserve_bytes == 0:
            reserve = "no activation reserve is kept (--activation-reserve SIZE or 'estimate')"
        elif res.activation_reserve_how.startswith("estimate"):
            reserve = f"activation reserve {fmt_bytes(res.activation_reserve_bytes)} is an estimate"
        else:
            reserve = f"activation reserve {fmt_bytes(res.activation_reserve_bytes)} as given"
        capacity = (
            " GPU capacities are datasheet figures read as GiB (--gpu-memory for a measured total)."
            if res.gpu is not None
            else ""
        )
        console.print(
            f"{reserve}; the engine profiles the real peak at startup.{capacity}",
            markup=False,
            soft_wrap=True,
        )


@click.command(
    "kv-calc", short_help="KV bytes per token / block, weights, and what fits on a GPU, for any model config."
)
@click.argument("model", required=False)
@click.option(
    "--dtype", type=click.Choice(list(WEIGHT_DTYPES)), default="float16", show_default=True, help="weights' dtype"
)
@click.option(
    "--kv-cache-dtype",
    type=click.Choice(["auto", *KV_DTYPES]),
    default="auto",
    show_default=True,
    help="auto = --dtype",
)
@click.option(
    "--tensor-parallel-size", "-tp", default=1, show_default=True, type=int, help="GPUs the model is split over"
)
@click.option("--block-size", default=16, show_default=True, type=int, help="tokens per KV block")
@click.option("--gpu", default=None, help=f"a catalogue GPU: {', '.join(GPUS)}")
@click.option("--gpu-memory", default=None, help="memory of one GPU instead of --gpu: 80GiB, 80GB, 24e9, ...")
@click.option(
    "--gpu-memory-utilization",
    default=0.9,
    show_default=True,
    type=float,
    help="share of GPU memory for weights + activations + KV",
)
@click.option(
    "--activation-reserve",
    default="0",
    show_default=True,
    help="memory per GPU kept for activations and buffers: a size (e.g. 2GiB), or 'estimate' "
    "(analytical, at --max-num-batched-tokens / --max-num-seqs)",
)
@click.option(
    "--max-num-batched-tokens",
    default=2048,
    show_default=True,
    type=int,
    help="tokens per step the 'estimate' reserve assumes",
)
@click.option(
    "--max-num-seqs", default=64, show_default=True, type=int, help="sequences per step the 'estimate' reserve assumes"
)
@click.option("--seq-len", default=None, type=int, help="tokens per sequence (prompt + output): how many fit")
@click.option("--list", "list_", is_flag=True, help="print the model and GPU catalogues")
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON")
def kv_calc_command(
    model,
    dtype,
    kv_cache_dtype,
    tensor_parallel_size,
    block_size,
    gpu,
    gpu_memory,
    gpu_memory_utilization,
    activation_reserve,
    max_num_batched_tokens,
    max_num_seqs,
    seq_len,
    list_,
    as_json,
):
    """KV-cache bytes per token and per block, weights per GPU, and how many tokens and SEQ_LEN
    sequences fit, for MODEL: a catalogue name (--list), a Hugging Face repository id that a
    catalogue entry cites, a config.json, an HF model folder, a .gguf file, or 'bundled'. Nothing
    is downloaded. Exit status: 0, or 1 when the model does not fit the GPU(s) asked for (--gpu or
    --gpu-memory); the verdict line says why (with --json: on stderr, stdout stays JSON).

    \b
    workbench kv-calc llama-2-13b
    workbench kv-calc meta-llama/Llama-2-70b-hf --gpu H100-80GB
    workbench kv-calc llama-2-70b --tensor-parallel-size 4 --gpu A100-80GB --seq-len 4096
    workbench kv-calc path/to/config.json --gpu-memory 24GiB --kv-cache-dtype fp8
    """
    if list_:
        print_catalog()
        return
    if not model:
        raise click.UsageError(
            "give a MODEL: a catalogue name (workbench kv-calc --list), a config.json, an HF model folder "
            "or a .gguf file"
        )
    with user_errors():
        res = kv_calc(
            model,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            tensor_parallel_size=tensor_parallel_size,
            block_size=block_size,
            gpu=gpu,
            gpu_memory=gpu_memory,
            gpu_memory_utilization=gpu_memory_utilization,
            activation_reserve=activation_reserve,
            seq_len=seq_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
        )
    if as_json:
        click.echo(json.dumps(res.to_dict(), indent=2, default=str))
        if res.fits is False:
            click.echo(res.verdict(), err=True)  # stdout stays one JSON document
    else:
        print_result(res)
    if res.fits is False:
        sys.exit(1)  # scripts can tell: `workbench kv-calc ... --gpu L4 && deploy`

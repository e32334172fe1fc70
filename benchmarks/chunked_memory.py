"""What chunked prefill does to memory: chapter 8's trace with the KV pool sized from a memory budget, chunked
prefill at a small token budget against whole prompts at ``max_model_len``'s, and the same question at GPU scale
from ``workbench kv-calc``'s activation estimate.

Real runs (:func:`workbench.labs.ch08_chunked_prefill.memory_runs`: the bundled model in float32, 1 GiB of
"device" memory, ``max_model_len`` 1024): the profiled activation peak, the KV pool it leaves, the peak share of
blocks in use, the fragmentation rate (mean over the steps holding memory, and highest) and preemptions. Every
figure is deterministic. GPU scale (:func:`~workbench.labs.ch08_chunked_prefill.gpu_memory_rows`): Qwen2.5-7B in
bfloat16 on one H100-80GB, ``max_model_len`` 32,768, ``max_num_seqs`` 256; arithmetic, no run.

    python benchmarks/chunked_memory.py
    python benchmarks/chunked_memory.py --budgets 128,256,512 --whole 1024
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@click.command(help=__doc__.split("\n\n")[0])
@click.option(
    "--budgets", default="256", show_default=True, help="chunked runs' max_num_batched_tokens, comma-separated"
)
@click.option("--whole", default=1024, show_default=True, help="the whole-prompt run's budget (>= the longest prompt)")
def main(budgets: str, whole: int) -> None:
    import workbench
    from workbench.labs import ch08_chunked_prefill as ch

    print(f"# workbench from {workbench.__file__}")
    trace = ch.chunked_trace(num_decodes=3, decode_tokens=40, num_long=2, first_arrival=4, every=22)
    runs = [(int(b), True) for b in budgets.split(",")] + [(whole, False)]
    rows = [ch.memory_row(r) for r in ch.memory_runs(runs, trace=trace, dtype="float32").values()]
    print(ch.memory_table(rows))
    print()
    print(ch.memory_verdict([rows[0], rows[-1]]))
    print()
    print(ch.gpu_memory_table(ch.gpu_memory_rows()))


if __name__ == "__main__":
    main()

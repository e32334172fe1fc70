"""``torchrun --nproc-per-node N -m workbench.entrypoints.torchrun [engine arguments] [--max-tokens T]
[--prompt P ...] [--prompt-ids 1,5,9 ...]``: rank 0 builds the engine with ``tensor_parallel_size=N``
(every engine argument is a flag, as in ``workbench run``), runs the prompts greedily and prints each
output's token ids and text; the other ranks serve it (:func:`workbench.executor.tensor_parallel.serve`).
"""

from __future__ import annotations

import os
import signal
import sys

import click
import torch

from workbench.cli.options import engine_args, engine_options
from workbench.executor.tensor_parallel import _torchrun_env, serve


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--max-tokens", default=16, show_default=True, type=int, help="output cap per prompt")
@click.option("--prompt", "prompts", multiple=True, help="a text prompt (repeatable)")
@click.option("--prompt-ids", multiple=True, help="comma-separated token ids (repeatable)")
@engine_options(exclude=("tensor_parallel_size",))
def main(max_tokens: int, prompts: tuple[str, ...], prompt_ids: tuple[str, ...], **kw) -> None:
    launched = _torchrun_env()
    if launched is None:
        raise click.UsageError("run this under torchrun (it reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT)")
    rank, n = launched
    args = engine_args(kw)
    os.environ.setdefault("WORKBENCH_TP_BACKEND", "nccl" if str(args["device"]).startswith("cuda") else "gloo")
    os.environ.setdefault("WORKBENCH_TP_TIMEOUT", str(args["distributed_timeout_s"]))
    if rank != 0:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
        serve()
        return
    from workbench.entrypoints.llm import LLM
    from workbench.sampling import SamplingParams

    llm = LLM(**(args | {"tensor_parallel_size": n}))
    try:
        todo = list(prompts) + [[int(t) for t in p.split(",")] for p in prompt_ids] or ["The capital of France is"]
        for o in llm.generate(todo, SamplingParams(max_tokens=max_tokens, temperature=0.0)):
            print(f"{o.outputs[0].token_ids}\t{o.outputs[0].text!r}", flush=True)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # torchrun stops ranks with SIGTERM
    main()

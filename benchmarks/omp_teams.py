"""Torch's small ops on a second thread, with and without an OpenMP team on the main thread.

GNU OpenMP keeps one team of worker threads per thread that has started a parallel region, and throttles every
worker's spin once the threads of all teams outnumber the CPUs (``workbench/omp_wait.py``). This script shows the
effect that made ``AsyncLLM`` build its engine on the thread that steps it. Three cases, each in a fresh process
(an OpenMP team lives as long as its thread):

* ``main``: the ops on the main thread;
* ``thread``: the ops on a second thread, the main thread having run none;
* ``thread-after-main``: the ops on a second thread after the main thread ran them (two teams).

Each case times a few ops on 64 x 576 bfloat16 tensors (SmolLM2-135M's hidden size, a 64-row decode step), median
microseconds per call over ``--repeats`` batches. With ``--engine`` it also runs offline ``LLM.generate`` (64
prompts x 100 -> 128 tokens, greedy, bfloat16) and reports the median model time of the 64-row decode steps from the
engine's recorder: on the main thread, and on a second thread after the model loaded on the main thread. Run::

    .venv/bin/python benchmarks/omp_teams.py              # the ops, about 20 s on an idle machine
    .venv/bin/python benchmarks/omp_teams.py --engine     # and the engine's decode steps, about 1.5 min
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def time_ops(repeats: int) -> dict[str, float]:
    import torch

    x = torch.randn(64, 576, dtype=torch.bfloat16)
    w = torch.randn(1536, 576, dtype=torch.bfloat16)
    ops = {
        "add": lambda: x + x,
        "silu": lambda: torch.nn.functional.silu(x),
        "rms_norm": lambda: x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True)).to(x.dtype),
        "linear 576->1536": lambda: torch.nn.functional.linear(x, w),
    }
    out = {}
    for name, fn in ops.items():
        for _ in range(20):
            fn()
        per_batch = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(50):
                fn()
            per_batch.append((time.perf_counter() - t0) / 50 * 1e6)
        out[name] = statistics.median(per_batch)
    return out


def decode_model_ms(llm, prompts) -> float:
    from workbench import SamplingParams

    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
    steps = list(llm.llm_engine.recorder.steps)
    d = [s.model_time_s for s in steps[-140:] if s.num_prefill_tokens == 0 and s.num_decode_tokens == len(prompts)]
    return statistics.median(d) * 1e3


def child(case: str, repeats: int) -> dict:
    import torch

    import workbench

    res: dict = {"case": case, "imports": workbench.__file__, "threads": torch.get_num_threads()}
    if case.startswith("engine"):
        import random

        from workbench import LLM

        llm = LLM(dtype="bfloat16")  # loads on the main thread: its team exists from here on
        rng = random.Random(0)
        vocab = llm.tokenizer.vocab_size
        prompts = [{"prompt_token_ids": [rng.randrange(1000, vocab) for _ in range(100)]} for _ in range(64)]
        decode_model_ms(llm, prompts[:4])  # warm-up
        if case == "engine-main":
            res["decode_model_ms"] = decode_model_ms(llm, prompts)
        else:
            box = {}
            th = threading.Thread(target=lambda: box.update(ms=decode_model_ms(llm, prompts)))
            th.start()
            th.join()
            res["decode_model_ms"] = box["ms"]
        return res
    if case == "main":
        res["ops_us"] = time_ops(repeats)
        return res
    if case == "thread-after-main":
        time_ops(2)
    box = {}
    th = threading.Thread(target=lambda: box.update(time_ops(repeats)))
    th.start()
    th.join()
    res["ops_us"] = box
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=20, help="timed batches of 50 calls per op (default 20)")
    p.add_argument("--engine", action="store_true", help="also time the engine's 64-row decode steps")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.repeats)))
        return 0
    load0 = os.getloadavg()[0]
    if load0 > 1.0:
        print(f"# WARNING: 1-minute load average is {load0:.2f} at start: other processes share the CPUs and the "
              "single-team figures can jump to milliseconds when a thread is descheduled; run on an idle machine")
    cases = ["main", "thread", "thread-after-main"] + (["engine-main", "engine-thread-after-main"] if a.engine else [])
    env = {**os.environ, "PYTHONPATH": str(REPO) + (os.pathsep + os.environ["PYTHONPATH"] if "PYTHONPATH" in os.environ else "")}
    results = []
    for case in cases:
        r = subprocess.run([sys.executable, __file__, "--child", case, "--repeats", str(a.repeats)], env=env,
                           capture_output=True, text=True, check=True)  # fmt: skip
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"# imports {results[0]['imports']}; torch threads {results[0]['threads']}; {os.cpu_count()} CPUs; "
          f"load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after")  # fmt: skip
    ops = [r for r in results if "ops_us" in r]
    names = list(ops[0]["ops_us"])
    print("| op (64 x 576 bfloat16), us per call | " + " | ".join(r["case"] for r in ops) + " |")
    print("|---|" + "---:|" * len(ops))
    for n in names:
        print(f"| {n} | " + " | ".join(f"{r['ops_us'][n]:.1f}" for r in ops) + " |")
    for r in results:
        if "decode_model_ms" in r:
            print(f"# {r['case']}: 64-row decode step, model time median {r['decode_model_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the sampler costs per decode step at temperature 1.0 against greedy, on the bundled model's vocabulary.

Times :func:`workbench.sampling.sample` on random logits of ``--rows`` x 49,152 (SmolLM2's vocabulary) in float32,
greedy rows against temperature-1.0 rows with seeded per-row generators (what a server does when the client sends
no ``temperature``), and ``torch.multinomial`` alone on the same rows. Prints the median of ``--repeats`` calls per
case, in milliseconds per step, and the torch thread count::

    python benchmarks/sampler_cost.py              # 64 rows, 2 threads, 20 repeats
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from workbench.sampling import SamplingParams, sample

VOCAB = 49152


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64, help="sequences per step (default 64)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    logits = torch.randn(a.rows, VOCAB, generator=torch.Generator().manual_seed(0))
    greedy = [SamplingParams(temperature=0.0)] * a.rows
    hot = [SamplingParams(temperature=1.0)] * a.rows
    gens = [torch.Generator().manual_seed(i) for i in range(a.rows)]
    probs = logits.softmax(-1)
    cases = {
        "sample(), greedy": lambda: sample(logits, greedy, [None] * a.rows),
        "sample(), temperature 1.0": lambda: sample(logits, hot, gens),
        "torch.multinomial per row alone": lambda: [torch.multinomial(probs[i], 1, generator=gens[i]) for i in
                                                    range(a.rows)],  # fmt: skip
    }
    print(f"# {a.rows} rows x {VOCAB} logits, float32, {torch.get_num_threads()} threads, median of {a.repeats}")
    for name, fn in cases.items():
        print(f"{name:<34} {median_ms(fn, a.repeats):8.1f} ms per step")


if __name__ == "__main__":
    main()

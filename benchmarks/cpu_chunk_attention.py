"""Time the C++ chunk kernel against SDPA (prefill) and the C++ decode kernel (decode), one layer of SmolLM2's shapes.

``workbench.kernels.cpu_attention.paged_attention``; 9 query heads, 3 KV heads, head_dim 64, bfloat16,
block_size 16, blocks in a shuffled order:

* prefill: one prompt of L tokens, no cached context, against SDPA on the fresh K/V (``is_causal``, GQA), the
  reference backend's path for such a chunk;
* decode: 64 sequences of 250-500 tokens over 30 layers' caches (about 560 MB, so K/V stream from memory, as in
  the engine), against the C++ decode kernel (``paged_decode_attention``).

Prints medians of ``--calls`` timed calls and the ratio; prefill GFLOP/s count the causal half (4 x L^2/2 x heads
x head_dim). Needs AVX512-BF16 (``chunk_kernel_available``); exits 2 with the reason elsewhere.

    python benchmarks/cpu_chunk_attention.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from workbench.attention.torch_ref import gather_kv
from workbench.kernels import cpu_attention as ca

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def median_ms(fn, calls: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def prefill_case(L: int, calls: int) -> tuple[float, float]:
    """Median ms of the chunk kernel and of SDPA for one prompt of ``L`` tokens with no cached context."""
    nblk = -(-L // BLOCK)
    kc = torch.randn(nblk + 8, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()
    vc = torch.randn_like(kc)
    table = torch.tensor([random.Random(L).sample(range(nblk + 8), nblk)])
    q = torch.randn(L, HEADS, HEAD_DIM).bfloat16()
    start, ctx = torch.tensor([0, L]), torch.tensor([L])
    k, v = gather_kv(kc, table[0], L), gather_kv(vc, table[0], L)
    qs, ks, vs = (x.transpose(0, 1)[None] for x in (q, k, v))
    t_kernel = median_ms(lambda: ca.paged_attention(q, kc, vc, table, start, ctx, 0.125), calls)
    t_sdpa = median_ms(
        lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.125, enable_gqa=True), calls
    )
    return t_kernel, t_sdpa


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="64,320,800,2048", help="prefill prompt lengths (default 64,320,800,2048)")
    ap.add_argument("--calls", type=int, default=15, help="timed calls per case (default 15; at least 1)")
    ap.add_argument("--decode-seqs", type=int, default=64, help="decode sequences (default 64; 0 skips decode)")
    args = ap.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        ap.error(f"--lengths takes comma-separated integers, got {args.lengths!r}")
    if args.calls < 1 or min(lengths) < 1:
        ap.error(f"--calls and every --lengths entry must be at least 1, got {args.calls} and {args.lengths!r}")
    if not ca.chunk_kernel_available():
        print("the chunk kernel does not run here (it needs AVX512-BF16 and a C++ toolchain)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| prefill L | chunk kernel (ms) | GFLOP/s | SDPA on fresh K/V (ms) | GFLOP/s | SDPA / kernel |")
    print("|---:|---:|---:|---:|---:|---:|")
    for L in lengths:
        t_kernel, t_sdpa = prefill_case(L, args.calls)
        flop = 4 * L * L / 2 * HEADS * HEAD_DIM
        print(f"| {L} | {t_kernel:.2f} | {flop / t_kernel / 1e6:.0f} | {t_sdpa:.2f} | {flop / t_sdpa / 1e6:.0f} "
              f"| {t_sdpa / t_kernel:.2f}x |")  # fmt: skip
    if args.decode_seqs:
        n, pool = args.decode_seqs, 1600
        shape = (pool, BLOCK, KV_HEADS, HEAD_DIM)
        layers = [(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()) for _ in range(30)]
        lens = [random.Random(i).randint(250, 500) for i in range(n)]
        width = max(-(-x // BLOCK) for x in lens)
        perm = random.Random(1).sample(range(pool), pool)
        table = torch.tensor([[perm[(i * width + j) % pool] for j in range(width)] for i in range(n)])
        q, ctx, start = torch.randn(n, HEADS, HEAD_DIM).bfloat16(), torch.tensor(lens), torch.arange(n + 1)

        def old():
            for k, v in layers:
                ca.paged_decode_attention(q, k, v, table, ctx, 0.125)

        def new():
            for k, v in layers:
                ca.paged_attention(q, k, v, table, start, ctx, 0.125)

        t_old, t_new = median_ms(old, max(3, args.calls // 3)), median_ms(new, max(3, args.calls // 3))
        gb = sum(lens) * KV_HEADS * HEAD_DIM * 2 * 2 * 30 / 1e9
        print(f"\ndecode, {n} sequences x 30 layers ({gb:.2f} GB of K/V): chunk kernel {t_new:.1f} ms "
              f"({gb / t_new * 1e3:.1f} GB/s), decode kernel {t_old:.1f} ms ({gb / t_old * 1e3:.1f} GB/s), "
              f"decode / chunk {t_old / t_new:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

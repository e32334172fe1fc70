"""Compile every kernel ahead of time for a CUDA architecture, on a machine without a GPU.

The interpreter checks what a kernel computes, not whether it compiles: shape rules of ``tl.dot``,
dtype mixes, early returns and register/shared-memory use only show up in Triton's compiler. This
module runs that compiler down to a cubin (Triton ships ``ptxas``) for given GPU architectures,
so CI without a GPU still catches a kernel that would not build on one.

    python -m workbench.kernels.aot                      # sm_80 (A100) and sm_90 (H100/H200), fp16 and bf16
    python -m workbench.kernels.aot --arch 89 --dtype fp32

It needs Triton in compiled mode: run it in a process where ``TRITON_INTERPRET`` is unset.
"""

from __future__ import annotations

import argparse
import sys

from workbench.kernels import interpreter_forced, load_triton, next_power_of_2

#: (architecture, dtype) pairs compiled by default: Ampere and Hopper, the two half types.
DEFAULT_TARGETS = [(80, "fp16"), (80, "bf16"), (90, "fp16"), (90, "bf16")]


def _signature(fn, types: dict[str, str], constexprs: dict) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in constexprs else types[name]
    return sig


def kernel_sources(dtype: str = "fp16", head_dim: int = 128, group: int = 4, block_size: int = 16) -> dict:
    """``name -> (jit function, signature, constexprs)`` for every kernel, at one configuration."""
    if interpreter_forced():
        raise RuntimeError("kernels.aot compiles kernels: run it in a process without TRITON_INTERPRET=1")
    from workbench.kernels import cache_ops, paged_attention, prefill_attention

    t = f"*{dtype}"
    bd = max(16, next_power_of_2(head_dim))
    bh = max(16, next_power_of_2(group))
    out = {}
    for split in (False, True):
        fn = paged_attention._paged_decode_kernel
        ce = dict(
            GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_H=bh, BLOCK_D=bd, BLOCK_N=64,
            SPLIT=split, PARTITION_SIZE=512 if split else 64, UPCAST=False,
        )  # fmt: skip
        types = {n: "i32" for n in fn.arg_names if n.startswith("stride")}
        types |= dict(Q=t, K=t, V=t, Out=t, PartOut="*fp32", PartLse="*fp32", BlockTables="*i32")
        types |= dict(ContextLens="*i32", qk_scale="fp32")
        out[f"decode_{'split' if split else 'single'}"] = (fn, _signature(fn, types, ce), ce)
    fn = paged_attention._merge_partitions_kernel
    ce = dict(HEAD_DIM=head_dim, BLOCK_D=bd, PARTITION_SIZE=512, MAX_PARTS=64)
    types = {n: "i32" for n in fn.arg_names if n.startswith("stride")}
    types |= dict(Out=t, PartOut="*fp32", PartLse="*fp32", ContextLens="*i32")
    out["decode_merge"] = (fn, _signature(fn, types, ce), ce)
    fn = prefill_attention._paged_prefill_kernel
    ce = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=64, BLOCK_D=bd, BLOCK_N=64, UPCAST=False)
    types = {n: "i32" for n in fn.arg_names if n.startswith("stride")}
    types |= dict(Q=t, K=t, V=t, Out=t, BlockTables="*i32", QueryStartLoc="*i32", ContextLens="*i32")
    types |= dict(qk_scale="fp32")
    out["prefill"] = (fn, _signature(fn, types, ce), ce)
    fn = cache_ops._reshape_and_cache_kernel
    ce = dict(NUM_KV_HEADS=8, HEAD_DIM=head_dim, BLOCK_T=4, BLOCK_H=8, BLOCK_D=next_power_of_2(head_dim))
    types = {n: "i32" for n in fn.arg_names if n.startswith("stride")}
    types |= dict(K=t, V=t, KCache=t, VCache=t, SlotMapping="*i64", block_size="i32", num_tokens="i32")
    out["reshape_and_cache"] = (fn, _signature(fn, types, ce), ce)
    fn = cache_ops._copy_blocks_kernel
    ce = dict(CHUNK=4096)
    types = {n: "i32" for n in fn.arg_names if "stride" in n}
    types |= dict(Src=t, Dst=t, SrcIds="*i64", DstIds="*i64", block_numel="i32")
    out["copy_blocks"] = (fn, _signature(fn, types, ce), ce)
    return out


def compile_all(arch: int = 90, dtype: str = "fp16", **config) -> dict:
    """Compile every kernel for ``sm_{arch}``; returns ``name -> CompiledKernel`` (has ``asm["cubin"]``).

    Raises:
        triton.CompilationError (or another compiler error): a kernel does not compile.
    """
    triton = load_triton()
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    done = {}
    for name, (fn, sig, ce) in kernel_sources(dtype, **config).items():
        done[name] = triton.compile(ASTSource(fn, sig, ce), target=target, options={"num_warps": 4})
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, action="append", help="compute capability x10, e.g. 80, 90 (repeatable)")
    ap.add_argument("--dtype", action="append", choices=["fp16", "bf16", "fp32"], help="repeatable")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")
    args = ap.parse_args(argv)
    if args.arch or args.dtype:
        targets = [(a, d) for a in (args.arch or [80, 90]) for d in (args.dtype or ["fp16", "bf16"])]
    else:
        targets = DEFAULT_TARGETS
    for arch, dtype in targets:
        ks = compile_all(arch, dtype, head_dim=args.head_dim, group=args.group)
        shared = ", ".join(f"{n} {k.metadata.shared} B" for n, k in ks.items())
        print(f"sm_{arch} {dtype}: {len(ks)} kernels compiled; shared memory: {shared}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

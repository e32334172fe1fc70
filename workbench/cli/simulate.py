"""``workbench simulate`` (click): replay a trace on a simulated server, or calibrate the cost model."""

from __future__ import annotations

import json

import click

from workbench.cli.errors import user_errors
from workbench.cli.options import engine_args, engine_options, kv_figure_rows, kv_manager_line
from workbench.units import parse_size


def _spec(model, gpu, tensor_parallel_size, dtype, kv_cache_dtype, activation_reserve, nccl_nchannels, calibration):
    from workbench.kvcalc import load_arch
    from workbench.sim.calibrate import load_calibration
    from workbench.sim.engine import SimSpec
    from workbench.sim.hardware import find_hardware

    arch = load_arch(model)
    if calibration:
        hw, eff = load_calibration(calibration)
        if gpu.lower() != hw.name.lower():
            raise ValueError(
                f"--calibration {calibration} is for {hw.name!r} but --gpu is {gpu!r}; give --gpu {hw.name}"
            )
    else:
        from workbench.sim.cost import Efficiency

        hw, eff = find_hardware(gpu), Efficiency()
    if activation_reserve == "estimate":
        act = None
    else:
        try:
            act = parse_size(activation_reserve, allow_zero=True)
        except ValueError as e:
            raise ValueError(f"--activation-reserve: {e}, or 'estimate'") from None
    return SimSpec(arch, hw, tensor_parallel_size, dtype, kv_cache_dtype, eff, act, nccl_nchannels)


@click.command("simulate", short_help="Replay a trace on a simulated GPU server (or calibrate the cost model).")
@click.option(
    "--model",
    default="llama-2-70b",
    show_default=True,
    help="catalogue name (workbench kv-calc --list), config.json, HF folder or .gguf",
)
@click.option(
    "--gpu",
    default="A100-80GB",
    show_default=True,
    help="A100-40GB, A100-80GB, H100-80GB, H200, L4, T4, V100-32GB, or cpu (this machine, probed)",
)
@click.option(
    "--tensor-parallel-size",
    "--num-gpus",
    "-tp",
    "tensor_parallel_size",
    default=4,
    show_default=True,
    type=int,
    help="GPUs the model is split over",
)
@click.option(
    "--dtype",
    default="float16",
    show_default=True,
    type=click.Choice(["float16", "bfloat16", "float32"]),
    help="weights' dtype",
)
@click.option(
    "--kv-cache-dtype",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "float16", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"]),
)
@click.option(
    "--activation-reserve",
    default="estimate",
    show_default=True,
    help="memory per GPU for activations: a size (2GiB, 0) or 'estimate' (kv-calc's analytical bound)",
)
@click.option(
    "--nccl-nchannels",
    default=None,
    type=int,
    help="NCCL channels of the buffer model (workbench.comm) [default: its own]",
)
@click.option(
    "--calibration",
    default=None,
    type=click.Path(dir_okay=False),
    help="a calibration JSON (from --calibrate): its hardware profile and fitted efficiencies",
)
@click.option("--request-rate", default=12.0, show_default=True, type=float, help="requests per second")
@click.option("--duration", default=60.0, show_default=True, type=float, help="seconds of arrivals")
@click.option("--arrival", default="poisson", show_default=True, type=click.Choice(["poisson", "constant"]))
@click.option(
    "--dataset",
    default="sharegpt",
    show_default=True,
    help="sharegpt | alpaca (log-normal lengths, the vLLM paper's means) | a JSONL/JSON trace file",
)
@click.option(
    "--tenants",
    default=0,
    show_default=True,
    type=int,
    help="multi-tenant trace: this many tenants (Zipf-distributed), each with its own shared system prompt "
    "in front of every prompt (0: off)",
)
@click.option("--tenant-zipf", default=1.0, show_default=True, type=float, help="Zipf exponent of the tenants")
@click.option(
    "--system-prompt-len", default=1024, show_default=True, type=int, help="tokens of each tenant's system prompt"
)
@click.option(
    "--data-parallel-size",
    "-dp",
    "data_parallel_size",
    default=1,
    show_default=True,
    type=int,
    help="replicas of the TENSOR_PARALLEL_SIZE layout behind a router (GPUs in all: dp x tp)",
)
@click.option(
    "--routing-policy",
    default="round_robin",
    show_default=True,
    help="round_robin | random | power_of_two | least_loaded | cache_aware: a model of vllm-router's policies "
    "(docs/simulator.md), not the router itself",
)
@click.option("--cache-threshold", default=None, type=float, help="cache_aware's match threshold [0.3, vllm-router's]")
@click.option(
    "--balance-abs-threshold", default=None, type=int, help="cache_aware's load gap for balancing [64, vllm-router's]"
)
@click.option(
    "--balance-rel-threshold",
    default=None,
    type=float,
    help="cache_aware's load ratio for balancing [1.5, vllm-router's]",
)
@click.option(
    "--goodput",
    multiple=True,
    help="SLOs in ms a good request meets, as bench serve: --goodput ttft:500 tpot:50 (metrics: ttft, tpot)",
)
@click.option("--max-tokens", default=None, type=int, help="output cap of requests that end with EOS [max_model_len]")
@click.option("--window", default=600.0, show_default=True, type=float, help="timeline window (simulated s)")
@click.option(
    "--itl/--no-itl",
    default=True,
    show_default=True,
    help="keep every inter-token gap in requests.jsonl (long replays: tens of millions)",
)
@click.option("--output-dir", default="runs", show_default=True, help="parent of the run folder")
@click.option("--run-name", default=None, help="the run folder's name [sim-<timestamp>]")
@click.option("--progress/--no-progress", default=True, show_default=True)
@click.option(
    "--calibrate", is_flag=True, help="fit the cost model to real runs (--train) and report its error (--test)"
)
@click.option("--train", multiple=True, type=click.Path(file_okay=False), help="a real run folder to fit on (repeat)")
@click.option("--test", multiple=True, type=click.Path(file_okay=False), help="a held-out real run folder (repeat)")
@click.option("--calibration-out", default=None, help="where --calibrate writes its JSON [runs/calibration-<gpu>.json]")
@engine_options(
    exclude=(
        "model",
        "tokenizer",
        "dtype",
        "device",
        "device_memory",
        "attention_backend",
        "kv_cache_dtype",
        "block_map_every",
        "tensor_parallel_size",
        "distributed_executor_backend",
        "distributed_timeout_s",
    )
)
@click.argument("more_goodput", nargs=-1, metavar="")
def simulate_command(model, gpu, tensor_parallel_size, dtype, kv_cache_dtype, activation_reserve, nccl_nchannels,
                     calibration, request_rate, duration, arrival, dataset, tenants, tenant_zipf, system_prompt_len,
                     data_parallel_size, routing_policy, cache_threshold, balance_abs_threshold,
                     balance_rel_threshold, goodput, max_tokens, window, itl, output_dir, run_name, progress,
                     calibrate, train, test, calibration_out, more_goodput, **kw):  # fmt: skip
    """Replay a trace of requests on TENSOR_PARALLEL_SIZE simulated GPUs serving MODEL, with the real
    scheduler and KV manager and a cost model of the GPU; write a run folder like `workbench run`.

    \b
    workbench simulate --model llama-2-70b --gpu A100-80GB -tp 4 --gpu-memory-utilization 0.9 \\
        --max-num-seqs 256 --request-rate 12 --duration 7200 --no-itl
    workbench simulate --model llama-2-7b --gpu L4 -tp 1 --dataset alpaca --request-rate 4
    workbench simulate --model llama-2-70b --gpu H100-80GB -tp 4 -dp 2 --routing-policy cache_aware \\
        --tenants 16 --enable-prefix-caching --goodput ttft:2000 tpot:100

    With -dp N, N replicas (each its own scheduler and KV pool) sit behind a modelled router: the
    routing policies model vllm-router's rules (docs/simulator.md); they are not the router itself.
    workbench simulate --calibrate --gpu cpu --train runs/A --train runs/B --test runs/C
    """
    import sys

    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)  # a log or pipe: wide enough for -dp's table
    if calibrate:
        _calibrate(console, gpu, train, test, calibration_out)
        return
    if train or test:
        raise click.UsageError("--train / --test go with --calibrate")
    from workbench.sim.run import simulate_job
    from workbench.sim.trace import make_trace

    args = engine_args(kw)
    seed = args.pop("seed", 0)
    args.pop("device_memory", None)
    if nccl_nchannels is not None and (
        args.get("nccl_min_nchannels") is not None or args.get("nccl_max_nchannels") is not None
    ):
        raise click.UsageError(
            "--nccl-nchannels sets the channel count of the buffer model directly; --nccl-min-nchannels / "
            "--nccl-max-nchannels bound NCCL's own choice: give one or the other"
        )
    with user_errors():
        from workbench.sim.cluster import check_cluster_args

        check_cluster_args(data_parallel_size, routing_policy)
        if more_goodput and not goodput:
            raise click.UsageError(f"unexpected argument(s) {' '.join(more_goodput)}; did you mean --goodput?")
        slo = _goodput_slo([*goodput, *more_goodput])
        spec = _spec(model, gpu, tensor_parallel_size, dtype, kv_cache_dtype, activation_reserve, nccl_nchannels,
                     calibration)  # fmt: skip
        info = {"request_rate": request_rate, "duration_s": duration, "arrival": arrival, "dataset": dataset,
                "seed": seed}  # fmt: skip
        if tenants:
            from workbench.sim.trace import make_tenant_trace

            trace = make_tenant_trace(request_rate, duration, dataset, arrival, seed, num_tenants=tenants,
                                      zipf_s=tenant_zipf, system_prompt_len=system_prompt_len)  # fmt: skip
            info |= {"tenants": tenants, "tenant_zipf": tenant_zipf, "system_prompt_len": system_prompt_len}
        else:
            trace = make_trace(request_rate, duration, dataset, arrival, seed)
        info["num_requests"] = len(trace)
        common = dict(output_dir=output_dir, run_name=run_name, progress=progress, record_itl=itl, window_s=window,
                      trace_info=info, max_tokens=max_tokens)  # fmt: skip
        if data_parallel_size > 1:
            from workbench.sim.cluster import simulate_cluster

            router = {k: v for k, v in (("cache_threshold", cache_threshold),
                                        ("balance_abs_threshold", balance_abs_threshold),
                                        ("balance_rel_threshold", balance_rel_threshold)) if v is not None}  # fmt: skip
            res = simulate_cluster(spec, trace, data_parallel_size=data_parallel_size, routing_policy=routing_policy,
                                   seed=seed, ttft_slo_s=slo[0] if slo else None, tpot_slo_s=slo[1] if slo else None,
                                   router_args=router, **common, **args)  # fmt: skip
            _print_cluster(console, spec, res)
            return
        res = simulate_job(spec, trace, goodput_slo=slo, **common, **args)
    s = res.summary
    eng = res.engine

    def ms(v):
        return "n/a" if v is None else f"{v * 1000:,.1f} ms"

    t = Table(title=f"workbench simulate: {spec.arch.name} on {eng.memory.device_name}")
    t.add_column("metric")
    t.add_column("value", justify="right", overflow="fold")
    rows = [
        ("memory", eng.memory.summary_line()),
        ("KV manager", kv_manager_line(eng.config.to_dict())),
        ("cost model", spec.efficiency.source),
        (
            "requests (finished / errors)",
            f"{s['requests_total']:,} ({s['requests_finished']:,} / {s['requests_errored']})",
        ),
        ("simulated duration", f"{s['simulated_duration_s']:,.1f} s"),
        ("replay took (this machine)", f"{s['replay_wall_s']:,.1f} s for {s['num_steps']:,} steps"),
        ("request throughput", f"{s['request_throughput_req_s']:,.2f} req/s"),
        ("output throughput", f"{s['output_throughput_tok_s']:,.1f} tok/s"),
        ("TTFT p50 / p99", f"{ms(s['ttft_p50_s'])} / {ms(s['ttft_p99_s'])}"),
        ("TPOT p50 / p99", f"{ms(s['tpot_p50_s'])} / {ms(s['tpot_p99_s'])}"),
        *([("goodput", f"{s['request_goodput_req_s']:,.2f} req/s")] if "request_goodput_req_s" in s else []),
        ("mean requests batched per step", f"{s['batched_reqs_mean']:.1f}"),
        ("KV blocks used (peak / pool)", f"{s['blocks_used_peak']:,} / {eng.memory.num_blocks:,}"),
        ("preemptions", f"{s['preemptions_total']:,}"),
        *kv_figure_rows(s, eng.config.to_dict()),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    refused = [r for r in eng.recorder.requests if r.error]
    if refused:
        console.print(
            f"{len(refused):,} request(s) refused, each with its reason in requests.jsonl; the first: {refused[0].error}"
        )
    if res.run_dir is not None:
        console.print(f"report:   {res.run_dir / 'report.html'}")
        console.print(f"steps:    {res.run_dir / 'steps.jsonl'}")
        console.print(f"requests: {res.run_dir / 'requests.jsonl'}")
        console.print(f"timeline: {res.run_dir / 'timeline.json'}")


def _goodput_slo(items) -> tuple[float | None, float | None] | None:
    """``--goodput`` (bench serve's ``NAME:MS`` pairs) as ``(ttft_slo_s, tpot_slo_s)``; ``None`` when not given."""
    if not items:
        return None
    from workbench.bench.serve import parse_goodput

    slo = parse_goodput(list(items))
    if "e2el" in slo:
        raise ValueError("--goodput e2el: workbench simulate's goodput takes ttft and tpot objectives")
    return tuple(None if slo.get(k) is None else slo[k] / 1000 for k in ("ttft", "tpot"))


def _print_cluster(console, spec, res) -> None:
    """One table row per replica, the overall line and the GPUs in all."""
    from rich.table import Table

    from workbench.kvcalc import fmt_bytes as format_bytes

    s, reps = res.summary, res.replicas
    tp = spec.tensor_parallel_size
    dev = reps[0].engine.memory.device_name

    def ms(v):
        return "n/a" if v is None else f"{v * 1000:,.0f}"

    t = Table(title=f"workbench simulate: {spec.arch.name}, {len(reps)} replicas of {dev} ({res.routing_policy})")
    for c in ("replica", "routed", "finished", "TTFT p50/p99 ms", "out tok/s", "prefill tok computed",
              "prefix hit", "preempt", "per rank: weights / KV / NCCL"):  # fmt: skip
        t.add_column(c, justify="right")
    for i, r in enumerate(s["replicas"]):
        m = r["per_rank_memory"]
        hit = r["prefix_cache_hit_rate_frac"]
        t.add_row(str(i), f"{r['requests_routed']:,}", f"{r['requests_finished']:,}",
                  f"{ms(r['ttft_p50_s'])} / {ms(r['ttft_p99_s'])}", f"{r['output_throughput_tok_s']:,.1f}",
                  f"{r['prefill_tokens_computed']:,}", "n/a" if hit is None else f"{hit:.1%}",
                  f"{r['preemptions_total']:,}",
                  " / ".join(format_bytes(m[k]) for k in ("weights_bytes", "kv_cache_bytes", "nccl_buffer_bytes")))  # fmt: skip
    console.print(t)
    good = s["request_goodput_req_s"]
    console.print(
        f"overall: {s['requests_finished']:,}/{s['requests_total']:,} requests in {s['simulated_duration_s']:,.1f} "
        f"simulated s: {s['request_throughput_req_s']:,.2f} req/s, {s['output_throughput_tok_s']:,.1f} output tok/s, "
        f"TTFT p50/p99 {ms(s['ttft_p50_s'])} / {ms(s['ttft_p99_s'])} ms"
        + ("" if good is None else f", goodput {good:,.2f} req/s")
        + f", prefill tokens computed {s['prefill_tokens_computed']:,}, KV imbalance (max/mean) mean "
        f"{s['kv_imbalance_mean']:.2f} max {s['kv_imbalance_max']:.2f}",
        markup=False,
    )
    console.print(f"GPUs in all: {len(reps)} replicas x {tp} (tensor parallel) = {len(reps) * tp} x {spec.hardware.name}; "
                  f"replay took {res.replay_wall_s:,.1f} s on this machine", markup=False)  # fmt: skip
    if res.run_dir is not None:
        console.print(f"summary:  {res.run_dir / 'summary.json'}  (each replica's run: {res.run_dir / 'replica-<i>'})",
                      markup=False)  # fmt: skip


def _calibrate(console, gpu, train, test, out) -> None:
    from pathlib import Path

    from workbench.sim.calibrate import calibrate
    from workbench.sim.hardware import find_hardware

    if not train:
        raise click.UsageError(
            "--calibrate needs at least one real run folder: --train runs/<folder> (write them with workbench run)"
        )
    with user_errors():
        cal = calibrate(list(train), list(test), find_hardware(gpu))
    path = cal.save(out or Path("runs") / f"calibration-{cal.hardware.name}.json")
    e = cal.efficiency
    console.print(
        f"fitted on {len(train)} run(s), {cal.fit.num_steps} steps: compute efficiency {e.compute:.3f} of "
        f"{cal.hardware.peak_flops / 1e9:,.1f} GFLOP/s, memory efficiency {e.memory:.3f} of "
        f"{cal.hardware.hbm_bandwidth / 1e9:,.1f} GB/s, overhead {e.overhead_s * 1e3:.2f} ms/step + "
        f"{e.per_seq_s * 1e3:.3f} ms/sequence; {cal.fit.compute_bound_steps} steps compute-bound",
        markup=False,
    )
    from rich.table import Table

    t = Table(title="step-time and throughput error of the simulator against real runs")
    for c in ("set", "run", "steps (matched)", "median |step error|", "real tok/s", "sim tok/s", "throughput error"):
        t.add_column(c)
    for name, rows in (("fit", cal.train), ("held out", cal.test)):
        for r in rows:
            t.add_row(name, r["run"], f"{r['steps']} ({r['steps_matched']})", f"{r['median_abs_step_error']:.1%}",
                      f"{r['real_throughput_tok_s']:,.1f}", f"{r['sim_throughput_tok_s']:,.1f}",
                      f"{r['throughput_error']:+.1%}")  # fmt: skip
    console.print(t)
    held = cal.held_out_step_error()
    if held is not None:
        console.print(f"held-out median |step-time error| {held:.1%} over {sum(r['steps'] for r in cal.test)} steps",
                      markup=False)  # fmt: skip
    console.print(f"calibration: {path}  (use it: workbench simulate --gpu {cal.hardware.name} --calibration {path})",
                  markup=False)  # fmt: skip
    click.echo(json.dumps({"held_out_median_abs_step_error": held}))

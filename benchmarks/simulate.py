"""Simulator benchmarks (issue 6): replay speed, fidelity against real CPU runs, and the case-study replay.

Part ``speed``: the whole ``workbench simulate`` command of 2 hours of ShareGPT-like Poisson traffic at 12
requests/s (86,400 requests) for Llama-2-70B on 4 x A100-80GB (``gpu_memory_utilization`` 0.9, ``max_num_seqs``
256, no ITL lists), each run in a fresh process: its wall time and its replay's (median of ``--repeats``), and the
steps simulated. ``--against REF`` alternates the tree of commit REF with this one and prints which package each run
imported, so that a before/after comparison cannot time one tree twice.

Part ``fidelity``: real runs of the bundled model on this CPU (``workbench run`` folders; ``--record``
makes them), the cost model fitted on the ``--train`` ones and its error on the held-out ones:
median absolute step-time error and output-throughput error (:mod:`workbench.sim.calibrate`).

Part ``case-study``: the case of the course's production stage — 70B on 4 x A100-80GB, util 0.9,
``max_num_seqs`` 256, two hours — at several request rates; per 10-minute window: requests
arrived / finished per second, TTFT p50 / p99, queueing time, preempted requests, running and
waiting requests, KV utilization and fragmentation rate.

    python benchmarks/simulate.py speed --repeats 3
    python benchmarks/simulate.py speed --against 3d30c99 --repeats 2     # before/after, alternated
    python benchmarks/simulate.py fidelity --record --out runs/bench-sim-fidelity.json
    python benchmarks/simulate.py case-study --rates 6,12 --duration 7200
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[1]


def _machine() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "load_1min": os.getloadavg()[0]}


def _case(rate: float, duration: float, seed: int, max_num_seqs: int = 256, util: float = 0.9, record_steps=True):
    from workbench.catalog import MODELS
    from workbench.config import EngineConfig
    from workbench.sim import SimEngine, SimSpec, find_hardware, make_trace

    spec = SimSpec(MODELS["llama-2-70b"], find_hardware("A100-80GB"), 4)
    eng = SimEngine(EngineConfig(gpu_memory_utilization=util, max_num_seqs=max_num_seqs), spec)
    eng.record_itl = False
    trace = make_trace(rate, duration, "sharegpt", "poisson", seed)
    eng.add_trace(trace)
    t0, c0 = time.perf_counter(), time.process_time()
    eng.run()
    return eng, trace, time.perf_counter() - t0, time.process_time() - c0


@click.group()
def cli():
    """Simulator benchmarks (results as JSON; a table on stdout)."""


#: The case-study replay as a user types it (``speed`` appends ``--output-dir``).
SPEED_ARGS = ["simulate", "--model", "llama-2-70b", "--gpu", "A100-80GB", "--tensor-parallel-size", "4",
              "--gpu-memory-utilization", "0.9", "--max-num-seqs", "256", "--no-itl", "--no-progress"]  # fmt: skip

def _timed_command(tree: Path, rate: float, duration: float, seed: int, out: Path) -> dict:
    """One whole ``workbench simulate`` command of the case study, run by ``tree``'s package in a child process."""
    from trees import run_workbench

    args = [*SPEED_ARGS, "--request-rate", str(rate), "--duration", str(duration), "--seed", str(seed)]
    run = run_workbench(tree, [*args, "--output-dir", str(out)])
    summary = json.loads(next(out.glob("*/summary.json")).read_text())
    return {"tree": str(tree), "workbench": run["workbench"], "seed": seed, "whole_s": run["wall_s"],
            "cpu_s": run["cpu_s"], "replay_s": summary["replay_wall_s"], "steps": summary["num_steps"]}  # fmt: skip


@cli.command()
@click.option("--rate", default=12.0, show_default=True, help="requests per second")
@click.option("--duration", default=7200.0, show_default=True, help="seconds of arrivals")
@click.option("--repeats", default=3, show_default=True, help="runs per tree (trace seeds first-seed, first-seed+1, ...)")
@click.option("--first-seed", default=0, show_default=True)
@click.option("--against", "ref", default=None, help="a git commit to compare with: its tree and this one alternate")
@click.option("--out", default="runs/bench-sim-speed.json", show_default=True)
def speed(rate, duration, repeats, first_seed, ref, out):
    """Time the whole `workbench simulate` command of the case study (70B, 4 x A100-80GB, util 0.9, max_num_seqs 256,
    RATE req/s for DURATION s, no ITL lists), each run in a fresh process, and its replay (the summary's
    replay_wall_s). With --against REF, REF's tree (git archive) and this one (the working tree, uncommitted changes
    included) alternate, seed by seed.

    Prints every run (whole command and replay in wall seconds, steps simulated, the workbench package it imported),
    then each tree's medians and, with --against, this tree's whole command / REF's (below 1: this tree is faster).
    Writes every run to --out as JSON."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-sim-speed-") as tmp:
        trees = {"this tree": REPO}
        if ref:
            from trees import export_tree

            trees = {ref: export_tree(ref, Path(tmp) / "ref"), "this tree": REPO}
        rows = []
        for k, seed in enumerate(range(first_seed, first_seed + repeats)):
            for label, tree in trees.items():
                r = _timed_command(tree, rate, duration, seed, Path(tmp) / f"run-{k}-{len(rows)}")
                r |= {"label": label, "load_1min": os.getloadavg()[0]}
                rows.append(r)
                print(f"{label:>12} seed {seed}: whole command {r['whole_s']:6.1f} s, replay {r['replay_s']:6.1f} s, "
                      f"{r['steps']:,} steps; workbench.__file__ = {r['workbench']}", flush=True)  # fmt: skip
        med = {
            label: {k: statistics.median(r[k] for r in rows if r["label"] == label) for k in ("whole_s", "replay_s")}
            for label in trees
        }
    for label, m in med.items():
        print(f"median {label:>12}: whole command {m['whole_s']:.1f} s, replay {m['replay_s']:.1f} s")
    if ref:
        print(f"this tree / {ref}: whole command {med['this tree']['whole_s'] / med[ref]['whole_s']:.2f}x")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"rate": rate, "duration_s": duration, "against": ref, "machine": _machine(),
                                     "runs": rows, "median": med}, indent=2))  # fmt: skip


#: settings of the real runs ``fidelity --record`` makes (workbench run arguments)
RECORD = [
    dict(num_prompts=12, max_tokens=32, max_num_seqs=4),
    dict(num_prompts=16, max_tokens=24, max_num_seqs=16, block_size=32, max_num_batched_tokens=512),
    dict(num_prompts=8, max_tokens=48, max_num_seqs=8),
    dict(num_prompts=20, max_tokens=24, max_num_seqs=10, max_num_batched_tokens=256),
    dict(num_prompts=10, max_tokens=40, max_num_seqs=2),
]


def median_run(folders: list[Path], dest: Path) -> Path:
    """One run folder whose step times are the per-step medians of repeated real runs of one setting.

    Greedy decoding makes the repeats schedule the same steps (checked); their times differ by
    what else the machine ran meanwhile. ``summary.json``'s throughput is the median of the repeats'.

    Raises:
        ValueError: the repeats did not schedule the same steps.
    """
    runs = [[json.loads(x) for x in (f / "steps.jsonl").read_text().splitlines()] for f in folders]
    shape = [[(s["num_prefill_tokens"], s["num_decode_tokens"]) for s in r] for r in runs]
    if any(sh != shape[0] for sh in shape):
        raise ValueError(f"the repeats {[str(f) for f in folders]} scheduled different steps; cannot take medians")
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "requests.jsonl"):
        (dest / name).write_text((folders[0] / name).read_text())
    steps = []
    for i, s in enumerate(runs[0]):
        s = dict(s)
        s["wall_time_s"] = statistics.median(r[i]["wall_time_s"] for r in runs)
        steps.append(s)
    (dest / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    sums = [json.loads((f / "summary.json").read_text()) for f in folders]
    summary = dict(sums[0])
    summary["output_throughput_tok_s"] = statistics.median(x["output_throughput_tok_s"] for x in sums)
    summary["wall_time_s"] = statistics.median(x["wall_time_s"] for x in sums)
    summary["repeats"] = [str(f) for f in folders]
    # the machine's own noise: how far one repeat's step times sit from the per-step medians, and
    # the spread of the repeats' throughputs (the floor of any model's error against one real run)
    dev = [abs(r[i]["wall_time_s"] - s["wall_time_s"]) / s["wall_time_s"] for r in runs for i, s in enumerate(steps)]
    summary["repeat_vs_median_step_error"] = statistics.median(dev)
    thr = [x["output_throughput_tok_s"] for x in sums]
    summary["repeat_throughput_range"] = [min(thr), max(thr)]
    (dest / "summary.json").write_text(json.dumps(summary, indent=2))
    return dest


@cli.command()
@click.option("--record", is_flag=True, help="make the real runs first (RECORD settings, bundled model, CPU)")
@click.option("--repeats", default=3, show_default=True, help="real runs per setting; per-step medians are compared")
@click.option("--runs-dir", default="runs/sim-fidelity", show_default=True, help="where the real runs are / go")
@click.option(
    "--train",
    "train_idx",
    default="1,4",
    show_default=True,
    help="settings (indices into RECORD) to fit on; the rest are held out. Default: the largest and the smallest "
    "batch (max_num_seqs 16 and 2), so the held-out settings lie inside the fitted range",
)
@click.option("--out", default="runs/bench-sim-fidelity.json", show_default=True)
def fidelity(record, repeats, runs_dir, train_idx, out):
    """Fit the cost model on real CPU runs and report its error on held-out ones."""
    from workbench.sim.calibrate import calibrate
    from workbench.sim.hardware import cpu_profile

    d = Path(runs_dir)
    loads = []
    if record:
        from workbench.bench.run import run_job

        for k in range(repeats):  # repeats interleaved: a busy spell of the machine hits one repeat of several settings
            for i, kw in enumerate(RECORD):
                loads.append(os.getloadavg()[0])
                run_job(output_dir=d, run_name=f"run{i}-r{k}", progress=False, **kw)
    runs = {}
    for i in range(len(RECORD)):
        reps = sorted(p for p in d.glob(f"run{i}-r*") if (p / "steps.jsonl").is_file())
        if reps:
            runs[i] = median_run(reps, d / "median" / f"run{i}")
    train = [int(x) for x in train_idx.split(",") if x.strip()]
    test = [i for i in runs if i not in train]
    if any(i not in runs for i in train) or not test:
        raise click.ClickException(
            f"settings recorded in {d}: {sorted(runs)}; --train {train_idx} needs them (--record)"
        )
    hw = cpu_profile()
    cal = calibrate([runs[i] for i in train], [runs[i] for i in test], hw)
    res = cal.to_dict() | {"machine": _machine(), "load_1min_at_each_run": loads, "settings": RECORD}
    for name, rows in (("fit", res["train"]), ("held out", res["test"])):
        for r in rows:
            print(
                f"{name:8s} {r['run']}: {r['steps']} steps ({r['steps_matched']} matched), median |step error| "
                f"{r['median_abs_step_error']:.1%}, throughput real {r['real_throughput_tok_s']:.1f} / sim "
                f"{r['sim_throughput_tok_s']:.1f} tok/s ({r['throughput_error']:+.1%})"
            )
    print(f"held-out median |step error| over all steps: {res['held_out_median_abs_step_error']:.1%}")
    noise = {}
    for i, path in runs.items():
        sm = json.loads((path / "summary.json").read_text())
        if "repeat_vs_median_step_error" in sm:
            noise[i] = sm["repeat_vs_median_step_error"], sm["repeat_throughput_range"]
            print(
                f"setting {i} real repeats: median |repeat - median| step time {noise[i][0]:.1%}, "
                f"throughput {noise[i][1][0]:.2f} .. {noise[i][1][1]:.2f} tok/s"
            )
    res["real_repeat_noise"] = noise
    e = cal.efficiency
    print(
        f"fit: compute {e.compute:.3f} x {cal.hardware.peak_flops / 1e9:.1f} GFLOP/s, memory {e.memory:.3f} x "
        f"{cal.hardware.hbm_bandwidth / 1e9:.1f} GB/s, overhead {e.overhead_s * 1e3:.2f} ms + "
        f"{e.per_seq_s * 1e3:.3f} ms/seq; {cal.fit.compute_bound_steps} of {cal.fit.num_steps} steps compute-bound"
    )
    if loads:
        print(f"1-minute load average before each real run: {min(loads):.1f} .. {max(loads):.1f}")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=2))


@cli.command("case-study")
@click.option("--rates", default="6,12", show_default=True, help="comma-separated request rates (req/s)")
@click.option("--duration", default=7200.0, show_default=True)
@click.option("--window", default=600.0, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--out", default="runs/bench-sim-case-study.json", show_default=True)
def case_study(rates, duration, window, seed, out):
    """70B on 4 x A100-80GB, util 0.9, max_num_seqs 256: TTFT and throughput over time per rate."""
    from workbench.sim.run import timeline

    result = {"duration_s": duration, "window_s": window, "seed": seed, "rates": {}}
    for rate in [float(x) for x in rates.split(",")]:
        eng, trace, wall, cpu = _case(rate, duration, seed)
        reqs = [r.to_dict() for r in eng.recorder.requests]
        steps = eng.recorder.steps
        tl = timeline(reqs, window, eng.now)
        for w in tl:  # engine state per window: means over the steps that started in it
            ss = [s for s in steps if w["t_start_s"] <= s.time_s < w["t_start_s"] + window]
            n = max(1, len(ss))
            w["running_mean"] = sum(s.num_running for s in ss) / n
            w["waiting_mean"] = sum(s.num_waiting for s in ss) / n
            w["kv_utilization_mean"] = sum(s.kv_utilization for s in ss) / n
            w["fragmentation_rate_mean"] = sum(s.fragmentation_rate for s in ss) / n
            w["blocks_used_max"] = max((s.blocks_used for s in ss), default=0)
            w["preemptions"] = sum(s.num_preemptions for s in ss)
            w["step_ms_median"] = statistics.median(s.wall_time_s for s in ss) * 1e3 if ss else None
        result["rates"][str(rate)] = {
            "requests": len(trace),
            "steps": len(steps),
            "simulated_s": eng.now,
            "replay_wall_s": wall,
            "replay_cpu_s": cpu,
            "num_blocks": eng.memory.num_blocks,
            "memory": eng.memory.summary_line(),
            "preemptions": sum(s.num_preemptions for s in steps),
            "timeline": tl,
        }
        print(
            f"\nrate {rate} req/s: {len(trace):,} requests, {len(steps):,} steps, simulated {eng.now:,.0f} s, "
            f"replay {wall:,.0f} s wall / {cpu:,.0f} s CPU; preemptions {result['rates'][str(rate)]['preemptions']}"
        )
        print(
            "window(s) | arrived/s | finished/s | TTFT p50 | TTFT p99 | queue p50 | running | waiting | KV util | "
            "frag | preempt | step ms"
        )
        for w in tl:

            def f(v, scale=1.0, fmt="{:.2f}"):
                return "n/a" if v is None else fmt.format(v * scale)

            print(f"{w['t_start_s']:>6.0f} | {w['arrived'] / window:.2f} | {w['finished_req_s']:.2f} | "
                  f"{f(w['ttft_p50_s'], 1e3, '{:.0f} ms')} | {f(w['ttft_p99_s'], 1e3, '{:.0f} ms')} | "
                  f"{f(w['queue_p50_s'], 1, '{:.1f} s')} | {w['running_mean']:.0f} | {w['waiting_mean']:.0f} | "
                  f"{w['kv_utilization_mean']:.1%} | {w['fragmentation_rate_mean']:.1%} | {w['preemptions']} | "
                  f"{f(w['step_ms_median'], 1, '{:.1f}')}")  # fmt: skip
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    cli()

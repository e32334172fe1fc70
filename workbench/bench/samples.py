"""Benchmark requests for ``workbench bench serve``: prompts with their lengths in tokens and the
output length to ask for, from the datasets of ``vllm bench serve`` (``--dataset-name``).

* ``random``: prompts of random token ids, ``random_input_len`` tokens each (±
  ``random_range_ratio``), asking for ``random_output_len`` tokens (vLLM's defaults: 1024, 128, 0).
* ``prefix-repetition``: ``num_prefixes`` random prefixes of ``prefix_len`` tokens shared by the
  prompts, each followed by its own random suffix of ``suffix_len`` tokens (vLLM's defaults: 256,
  256, 10 prefixes, 128 output tokens) — the load that prefix caching serves.
  :func:`prefix_repetition_records` builds the same kind of load in token ids for ``workbench run --dataset
  prefix-repetition`` and the eviction benchmark, with tenants of Zipf-distributed popularity and an optional scan.
* ``sharegpt``: the first human turn of ShareGPT conversations (:func:`workbench.bench.datasets.load_prompts`),
  shuffled with the seed; the output length is the tokenised length of the ``"gpt"`` reply (or
  ``output_len``); conversations with a prompt or reply under 4 tokens, a prompt over 1,024 or
  both over 2,048 tokens are skipped, as vLLM's ShareGPT sampler does.
* ``jsonl``: the project's JSON Lines prompt files (:func:`workbench.bench.datasets.load_prompts`);
  the output length is a record's ``output_len``, else its ``max_tokens``, else ``output_len``,
  else 256 (vLLM's ``--custom-output-len`` default).

Lengths are counted with a tokenizer (:func:`load_tokenizer`): the bundled model's unless another
local one is named; nothing is downloaded. Sources: vLLM's ``vllm/benchmarks/datasets.py`` and
https://docs.vllm.ai/en/latest/cli/bench/serve.html.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from workbench.bench.datasets import PromptRecord, load_prompts

__all__ = [
    "DATASET_NAMES",
    "DEFAULT_JSONL_OUTPUT_LEN",
    "SampleRequest",
    "build_samples",
    "load_tokenizer",
    "prefix_repetition_records",
]

log = logging.getLogger(__name__)

DATASET_NAMES = ("random", "prefix-repetition", "sharegpt", "jsonl")
DEFAULT_JSONL_OUTPUT_LEN = 256
"""Output tokens asked for a JSON Lines prompt that gives none (vLLM's ``--custom-output-len`` default)."""

# vLLM's ShareGPT filter (``is_valid_sequence``): minimum prompt/reply and maximum prompt/total tokens
_SHAREGPT_MIN_LEN, _SHAREGPT_MAX_PROMPT, _SHAREGPT_MAX_TOTAL = 4, 1024, 2048


@dataclass
class SampleRequest:
    """One request of a benchmark.

    Attributes:
        prompt: text for ``/v1/completions``, or chat messages (``[{"role", "content"}]``) for
            ``/v1/chat/completions`` (a text prompt is sent there as one user message).
        prompt_len: prompt length in tokens, as the benchmark's tokenizer counts it.
        expected_output_len: ``max_tokens`` asked for, in tokens.
        request_id: the dataset's id of the prompt, if any.
    """

    prompt: str | list[dict[str, str]]
    prompt_len: int
    expected_output_len: int
    request_id: str | None = None


def load_tokenizer(tokenizer: str | None) -> tuple[object, str]:
    """The tokenizer that counts prompt tokens, and its id for the result (``tokenizer_id``).

    Args:
        tokenizer: ``None`` or the bundled model's name (``smollm2-135m`` or
            ``HuggingFaceTB/SmolLM2-135M-Instruct``): the bundled model's tokenizer, read from
            workbench's converted-model cache when the model was loaded before, else from the GGUF
            file; a local HF folder with tokenizer files; or a ``.gguf`` file. Never downloads.

    Raises:
        FileNotFoundError: the path does not exist (or the bundled package is missing).
        ValueError: the folder has no tokenizer files.
    """
    from transformers import AutoTokenizer

    from workbench.catalog import BUNDLED_MODEL, is_bundled_model
    from workbench.config import EngineConfig
    from workbench.model.loader import _load_tokenizer, bundled_model_path, converted_folder

    if tokenizer is None or is_bundled_model(tokenizer):
        source = bundled_model_path()
        folder = converted_folder(source, EngineConfig().resolved_cache_dir)
        tok = _load_tokenizer(folder) if folder.is_dir() else None
        if tok is None:
            tok = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        return tok, tokenizer or BUNDLED_MODEL
    path = Path(tokenizer).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"--tokenizer {tokenizer}: no such file or folder; give a local tokenizer folder or .gguf file "
            "(nothing is downloaded), or leave --tokenizer out to use the bundled model's"
        )
    if path.is_file():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name), tokenizer
    tok = _load_tokenizer(path)
    if tok is None:
        raise ValueError(f"--tokenizer {tokenizer}: the folder has no tokenizer files (tokenizer.json, ...)")
    return tok, tokenizer


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _ordinary_ids(tokenizer) -> np.ndarray:
    """Token ids a random prompt may use: the vocabulary without special tokens."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)


def _random_text(tokenizer, rng: np.random.Generator, ids: np.ndarray, length: int) -> tuple[str, int]:
    """Text of random tokens that re-tokenises to ``length`` tokens where decoding allows; returns it and
    its true length (decode → encode can merge or split tokens, so it is repaired a few rounds)."""
    if length <= 0:
        return "", 0
    tokens = list(rng.choice(ids, size=length))
    text = tokenizer.decode(tokens)
    for _ in range(10):
        tokens = _encode(tokenizer, text)
        if len(tokens) == length:
            break
        if len(tokens) > length:
            tokens = tokens[:length]
        else:
            tokens = tokens + list(rng.choice(ids, size=length - len(tokens)))
        text = tokenizer.decode(tokens)
    return text, len(_encode(tokenizer, text))


def build_samples(
    dataset_name: str,
    tokenizer,
    *,
    num_prompts: int,
    seed: int = 0,
    dataset_path: str | None = None,
    output_len: int | None = None,
    random_input_len: int = 1024,
    random_output_len: int = 128,
    random_range_ratio: float | tuple[float, float] = 0.0,
    random_prefix_len: int = 0,
    prefix_repetition_prefix_len: int = 256,
    prefix_repetition_suffix_len: int = 256,
    prefix_repetition_num_prefixes: int = 10,
    prefix_repetition_output_len: int = 128,
    disable_shuffle: bool = False,
    no_oversample: bool = False,
) -> list[SampleRequest]:
    """``num_prompts`` requests of ``dataset_name`` (see the module docstring), reproducible for a ``seed``.

    ``output_len`` (tokens), when given, replaces every request's output length (vLLM's
    ``--output-len``). Lengths in tokens; ``random_range_ratio`` in [0, 1) (one for both, or
    ``(input, output)``) makes input and output lengths uniform in ``[len * (1 - r), len * (1 + r)]``;
    ``random_prefix_len`` tokens of one random prefix go before every random prompt (vLLM's
    ``--random-prefix-len``). ``sharegpt`` is shuffled with the seed unless ``disable_shuffle``. A file
    with fewer usable prompts than ``num_prompts`` is oversampled (seeded draws of its prompts again,
    as vLLM), unless ``no_oversample``: then the run has fewer requests.

    Raises:
        ValueError: an unknown dataset name, a file with too few usable prompts, or (``jsonl``) chat
            messages, which need the chat endpoint (see :func:`workbench.bench.serve.run_bench_serve`).
    """
    rng = np.random.default_rng(seed)
    dataset_name = {"prefix_repetition": "prefix-repetition"}.get(dataset_name, dataset_name)  # vLLM's spelling
    if dataset_name == "random":
        ids = _ordinary_ids(tokenizer)
        in_r, out_r = random_range_ratio if isinstance(random_range_ratio, tuple) else (random_range_ratio,) * 2
        in_lo, in_hi = int(random_input_len * (1 - in_r)), int(random_input_len * (1 + in_r))
        out_lo = max(1, int(random_output_len * (1 - out_r)))
        out_hi = max(out_lo, int(random_output_len * (1 + out_r)))
        lowest = 0 if random_prefix_len else 1
        in_lens = rng.integers(max(lowest, in_lo), max(lowest, in_hi) + 1, size=num_prompts)
        out_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts)
        prefix = _random_text(tokenizer, rng, ids, random_prefix_len)[0]
        out = []
        for i in range(num_prompts):
            text, n = _random_text(tokenizer, rng, ids, int(in_lens[i]))
            if prefix:
                text, n = prefix + text, len(_encode(tokenizer, prefix + text))
            out.append(SampleRequest(text, n, output_len or int(out_lens[i]), f"random-{i}"))
        return out
    if dataset_name == "prefix-repetition":
        ids = _ordinary_ids(tokenizer)
        prefixes = [
            _random_text(tokenizer, rng, ids, prefix_repetition_prefix_len)[0]
            for _ in range(prefix_repetition_num_prefixes)
        ]
        out = []
        for i in range(num_prompts):
            suffix, _ = _random_text(tokenizer, rng, ids, prefix_repetition_suffix_len)
            text = prefixes[i % prefix_repetition_num_prefixes] + suffix
            n = len(_encode(tokenizer, text))
            out.append(SampleRequest(text, n, output_len or prefix_repetition_output_len, f"prefix-{i}"))
        order = rng.permutation(num_prompts)
        return [out[j] for j in order]
    if dataset_name == "sharegpt":
        records = load_prompts(dataset_path)
        if not disable_shuffle:
            random.Random(seed).shuffle(records)
        out = []
        no_reply = 0
        for r in records:
            if len(out) >= num_prompts:
                break
            if not isinstance(r.prompt, str):
                continue
            n_in = len(_encode(tokenizer, r.prompt))
            if output_len is not None:
                n_out = output_len
            elif r.reply is not None:
                n_out = len(_encode(tokenizer, r.reply))
                if (
                    n_in < _SHAREGPT_MIN_LEN
                    or n_out < _SHAREGPT_MIN_LEN
                    or n_in > _SHAREGPT_MAX_PROMPT
                    or n_in + n_out > _SHAREGPT_MAX_TOTAL
                ):
                    continue
            else:
                no_reply += 1  # no reply to take the output length from
                continue
            out.append(SampleRequest(r.prompt, n_in, n_out, r.id))
        if not out and no_reply:
            raise ValueError(
                f"--dataset-path {dataset_path}: no conversation has a gpt reply to take the output length "
                "from; give --output-len N (tokens) for every request"
            )
        return _oversample(out, num_prompts, seed, no_oversample, dataset_path, "usable conversations")
    if dataset_name == "jsonl":
        records = load_prompts(dataset_path, num_prompts=num_prompts)
        out = []
        for r in records:
            if isinstance(r.prompt, str):
                n_in = len(_encode(tokenizer, r.prompt))
            else:
                n_in = _chat_len(tokenizer, r.prompt)
            n_out = output_len or r.output_len or r.max_tokens or DEFAULT_JSONL_OUTPUT_LEN
            out.append(SampleRequest(r.prompt, n_in, n_out, r.id))
        return _oversample(out, num_prompts, seed, no_oversample, dataset_path, "prompts")
    raise ValueError(f"--dataset-name {dataset_name!r} is not one of {', '.join(DATASET_NAMES)}")


def _chat_len(tokenizer, messages: list[dict[str, str]]) -> int:
    try:
        return len(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
    except (ValueError, AttributeError, TypeError):  # no chat template: the contents alone
        return sum(len(_encode(tokenizer, m["content"])) for m in messages)


def _oversample(out: list, num_prompts: int, seed: int, no_oversample: bool, path, what: str) -> list:
    """``out`` filled up to ``num_prompts`` with seeded draws from itself (vLLM's oversampling), or as it
    is with ``no_oversample``.

    Raises:
        ValueError: the file gave no usable prompt at all.
    """
    _check_some(out, path, what)
    if len(out) >= num_prompts or no_oversample:
        if len(out) < num_prompts:
            log.warning("%s: %d %s for --num-prompts %d; --no-oversample: sending %d", path, len(out), what,
                        num_prompts, len(out))  # fmt: skip
        return out
    rng = random.Random(seed)
    log.warning("%s: %d %s for --num-prompts %d; oversampling (as vLLM; --no-oversample to send only these)",
                path, len(out), what, num_prompts)  # fmt: skip
    return out + [rng.choice(out) for _ in range(num_prompts - len(out))]


def _check_some(out: list, path, what: str) -> None:
    if not out:
        raise ValueError(f"--dataset-path {path}: no {what}; check the file's format")


def prefix_repetition_records(
    num_prompts: int,
    *,
    prefix_len: int = 256,
    suffix_len: int = 256,
    num_prefixes: int = 10,
    output_len: int | None = None,
    zipf: float = 0.0,
    scan_every: int = 0,
    scan_len: int | None = None,
    vocab_size: int = 1000,
    seed: int = 0,
) -> list[PromptRecord]:
    """A multi-tenant prefix-repetition prompt set, in token ids (reproducible for a ``seed``).

    ``num_prefixes`` tenants, each with its own system prompt of ``prefix_len`` random token ids; each request
    is one tenant's system prompt followed by its own random suffix of ``suffix_len`` ids (vLLM's
    ``prefix-repetition`` dataset and defaults, ``vllm/benchmarks/datasets.py``, which cycles its prefixes). Here
    the tenant of each request is drawn at random with Zipf-distributed popularity: tenant ``k`` (0-based) with
    probability proportional to ``1 / (k + 1) ** zipf`` (``zipf=0``: uniform; ~1: a few hot tenants and a long
    tail). With ``scan_every=N > 0`` every N-th request is instead a one-off *scan* prompt of ``scan_len`` random
    ids (default ``4 * prefix_len``) that shares nothing: the load under which LRU eviction flushes a hot system
    prompt (a scan in the page-replacement sense; O'Neil et al., "The LRU-K page replacement algorithm", SIGMOD
    1993). Token ids are uniform in ``[3, vocab_size)`` (ids below 3 are often special tokens), so the prompts fit
    any model with at least ``vocab_size`` tokens.

    Returns:
        ``num_prompts`` records: ``prompt`` the token ids, ``id`` ``"t<k>-<i>"`` (tenant ``k``, request ``i``) or
        ``"scan-<i>"``, ``max_tokens`` = ``output_len`` (``None``: the run's cap).

    Raises:
        ValueError: a count below 1 (``num_prompts``, ``prefix_len``, ``num_prefixes``, ``vocab_size`` under 4),
            a negative ``suffix_len``, ``scan_every`` or ``zipf``, or a ``scan_len`` below 1; the message names the value.
    """
    for name, v, lo in (
        ("num_prompts", num_prompts, 1),
        ("prefix_len", prefix_len, 1),
        ("suffix_len", suffix_len, 0),
        ("num_prefixes", num_prefixes, 1),
        ("scan_every", scan_every, 0),
        ("vocab_size", vocab_size, 4),
        ("scan_len", 1 if scan_len is None else scan_len, 1),
        ("output_len", 1 if output_len is None else output_len, 1),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"prefix-repetition: {name}={v!r} must be an integer >= {lo}")
    if not zipf >= 0:
        raise ValueError(f"prefix-repetition: zipf={zipf!r} must be >= 0 (0 = every tenant equally popular)")
    rng = np.random.default_rng(seed)
    systems = rng.integers(3, vocab_size, size=(num_prefixes, prefix_len)).tolist()
    weights = 1.0 / np.arange(1, num_prefixes + 1, dtype=np.float64) ** zipf
    tenants = rng.choice(num_prefixes, size=num_prompts, p=weights / weights.sum())
    scan = scan_len or 4 * prefix_len
    out = []
    for i, k in enumerate(tenants.tolist()):
        if scan_every and (i + 1) % scan_every == 0:
            ids, rid = rng.integers(3, vocab_size, size=scan).tolist(), f"scan-{i}"
        else:
            ids, rid = systems[k] + rng.integers(3, vocab_size, size=suffix_len).tolist(), f"t{k}-{i}"
        out.append(PromptRecord(ids, False, rid, max_tokens=output_len))
    return out

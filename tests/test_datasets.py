"""Tests for workbench.bench.datasets (the project's prompt set and the prompt-file loader)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from workbench.bench.datasets import (
    DEFAULT_PROMPTS_PATH,
    PromptRecord,
    default_prompts,
    load_prompts,
    select_prompts,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path:
    """``shared/data`` beside the checkout (a sibling of ``<repo>``): read-only public data beside the checkout, absent on most machines."""
    return Path(__file__).resolve().parents[2] / "shared" / "data"


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def jline(obj: object) -> str:
    return json.dumps(obj)


# --- the project's own prompt set -------------------------------------------------------


def test_default_prompts_path_is_in_repo_datasets_folder():
    assert DEFAULT_PROMPTS_PATH == REPO_ROOT / "datasets" / "default_prompts.jsonl"
    assert DEFAULT_PROMPTS_PATH.is_file()


def test_default_prompts_count_ids_and_types():
    records = default_prompts()
    assert len(records) >= 64
    assert all(isinstance(r, PromptRecord) for r in records)
    ids = [r.id for r in records]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"p\d{3}", i) for i in ids)
    assert all(r.chat is True for r in records)
    assert all(isinstance(r.prompt, str) and r.prompt.strip() == r.prompt for r in records)


def test_default_prompts_length_spread():
    lengths = [len(r.prompt) for r in default_prompts()]
    short = [n for n in lengths if n < 200]
    long_ = [n for n in lengths if n > 4000]
    documents = [n for n in lengths if n >= 1500]
    assert len(short) >= 20, "about a third should be short questions"
    assert len(documents) >= 20, "about a third should be long documents to summarise"
    assert len(long_) >= 4, "at least four documents over 4,000 characters"
    assert max(lengths) <= 6500


def test_default_prompts_file_has_kind_and_chat_fields():
    kinds = set()
    for line in DEFAULT_PROMPTS_PATH.read_text(encoding="utf-8").splitlines():
        obj = json.loads(line)
        assert set(obj) == {"id", "kind", "chat", "prompt"}
        assert obj["chat"] is True
        kinds.add(obj["kind"])
    assert {"question", "instruction", "code", "summarise"} <= kinds


def test_default_prompts_num_prompts_takes_first_n():
    everything = default_prompts()
    assert default_prompts(5) == everything[:5]
    assert default_prompts(0) == []
    assert default_prompts(10_000) == everything


# --- ShareGPT ---------------------------------------------------------------------------


def write_sharegpt(tmp_path: Path) -> Path:
    data = [
        {
            "id": "a1",
            "conversations": [
                {"from": "human", "value": "What is a KV cache?"},
                {"from": "gpt", "value": "It stores keys and values."},
                {"from": "human", "value": "Thanks, and why paged?"},
            ],
        },
        {"id": "b2", "conversations": []},  # no human turn: skipped
        {
            "id": "c3",
            "conversations": [{"from": "gpt", "value": "Hello!"}],
        },  # no human turn: skipped
        {
            "id": "d4",
            "conversations": [{"from": "human", "value": "   "}],
        },  # empty text: skipped
        {
            "id": "e5",
            "conversations": [
                {"from": "gpt", "value": "How can I help?"},
                {"from": "human", "value": "Write a haiku."},
            ],
        },
        {"conversations": [{"from": "human", "value": "No id here."}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")
    return path


def test_sharegpt_keeps_first_human_turn_and_skips_empty(tmp_path, caplog):
    path = write_sharegpt(tmp_path)
    with caplog.at_level(logging.WARNING, logger="workbench.bench.datasets"):
        records = load_prompts(path)
    assert records == [
        PromptRecord(prompt="What is a KV cache?", chat=True, id="a1"),
        PromptRecord(prompt="Write a haiku.", chat=True, id="e5"),
        PromptRecord(prompt="No id here.", chat=True, id="sharegpt-5"),
    ]
    assert "skipped 3 ShareGPT conversation" in caplog.text


def test_sharegpt_num_prompts(tmp_path):
    path = write_sharegpt(tmp_path)
    assert [r.id for r in load_prompts(path, num_prompts=2)] == ["a1", "e5"]
    assert len(load_prompts(path, num_prompts=99)) == 3
    assert load_prompts(path, num_prompts=0) == []


def test_sharegpt_wrong_structure_names_entry_and_formats(tmp_path):
    path = tmp_path / "list.json"
    path.write_text(json.dumps([{"prompt": "hi"}]), encoding="utf-8")
    with pytest.raises(ValueError, match=r"entry 1: expected an object with a \"conversations\" list") as err:
        load_prompts(path)
    assert "JSON Lines" in str(err.value)


def test_sharegpt_invalid_json_names_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[\n  {"id": "x", "conversations": []},\n  {"id": oops}\n]\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"broken\.json line 3: .*not valid JSON"):
        load_prompts(path)


def test_sharegpt_non_string_value(tmp_path):
    path = tmp_path / "v.json"
    path.write_text(json.dumps([{"id": "x", "conversations": [{"from": "human", "value": 5}]}]))
    with pytest.raises(ValueError, match=r'entry 1 turn 1: "value" must be a string'):
        load_prompts(path)


@pytest.mark.parametrize("name", ["ShareGPT_V3_filtered_500.json", "ShareGPT_V3_filtered_1000.json"])
def test_real_sharegpt_sample_when_present(name):
    path = shared_data_dir() / "sharegpt" / name
    if not path.is_file():
        pytest.skip(f"{path} not present (public ShareGPT sample lives beside the checkout only on some machines)")
    expected = int(re.search(r"_(\d+)\.json$", name).group(1))
    records = load_prompts(path)
    assert len(records) == expected
    assert all(r.chat and isinstance(r.prompt, str) and r.prompt.strip() for r in records)
    assert len(load_prompts(path, num_prompts=10)) == 10


# --- JSON Lines -------------------------------------------------------------------------


def test_jsonl_all_three_prompt_fields(tmp_path):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a prime."},
    ]
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            jline({"id": "q1", "prompt": "Hello?", "max_tokens": 32, "output_len": 7}),
            "",
            "   ",
            jline({"id": "q2", "messages": messages}),
            jline({"text": "Once upon a time", "chat": False}),
            jline({"id": 17, "prompt": "Integer id", "chat": None, "kind": "question"}),
        ],
    )
    records = load_prompts(path)
    assert records == [
        PromptRecord(prompt="Hello?", chat=True, id="q1", max_tokens=32, output_len=7),
        PromptRecord(prompt=messages, chat=True, id="q2"),
        PromptRecord(prompt="Once upon a time", chat=False, id="mixed:5"),
        PromptRecord(prompt="Integer id", chat=True, id="17"),
    ]


def test_jsonl_num_prompts_first_n_and_fewer_available(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [jline({"prompt": f"prompt {i}"}) for i in range(5)])
    assert [r.prompt for r in load_prompts(path, num_prompts=3)] == [
        "prompt 0",
        "prompt 1",
        "prompt 2",
    ]
    assert len(load_prompts(path, num_prompts=50)) == 5
    assert load_prompts(path, num_prompts=3) == load_prompts(path, num_prompts=3)


def test_jsonl_unicode_line_separators_and_crlf_stay_inside_prompts(tmp_path):
    text = "para one\u2028para two\x1cend\u00e9"
    path = tmp_path / "u.jsonl"
    line = json.dumps({"prompt": text}, ensure_ascii=False)
    path.write_bytes((line + "\r\n" + jline({"prompt": "second"}) + "\r\n").encode("utf-8"))
    records = load_prompts(path)
    assert [r.prompt for r in records] == [text, "second"]
    assert [r.id for r in records] == ["u:1", "u:2"]


def test_jsonl_accepts_str_path_and_bom(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + jline({"prompt": "hi"}).encode() + b"\n")
    assert load_prompts(str(path)) == [PromptRecord(prompt="hi", chat=True, id="bom:1")]


MALFORMED = [
    ('{"prompt": "ok"', r"not valid JSON .*each line must be one complete JSON object"),
    (
        jline({"id": "x"}),
        r'missing "prompt" \(expected one of "prompt", "messages", "text"\); add',
    ),
    (
        jline({"prompt": "   "}),
        r'"prompt" is empty; put the prompt text in it or delete the line',
    ),
    (jline({"text": ""}), r'"text" is empty'),
    (
        jline({"prompt": 42}),
        r'"prompt" must be a string, got int 42; quote the prompt text',
    ),
    (jline({"prompt": ["a"]}), r'"prompt" must be a string'),
    (jline({"messages": "hi"}), r'"messages" must be a non-empty list.*"role": "user"'),
    (jline({"messages": []}), r'"messages" must be a non-empty list'),
    (
        jline({"messages": [{"role": "user"}]}),
        r'message 1 must be \{"role": str, "content": str\}',
    ),
    (
        jline({"messages": [{"role": "user", "content": " "}]}),
        r'every message in "messages" is empty',
    ),
    (
        jline({"messages": [{"role": "user", "content": "x"}], "chat": False}),
        r'"messages" needs "chat": true',
    ),
    (
        jline({"prompt": "a", "text": "b"}),
        r'has both "prompt" and "text"; keep exactly one',
    ),
    (
        jline({"prompt": "a", "chat": "yes"}),
        r'"chat" must be true or false.*JSON boolean',
    ),
    (
        jline({"prompt": "a", "max_tokens": 0}),
        r'"max_tokens" must be a positive integer \(tokens\) or null',
    ),
    (
        jline({"prompt": "a", "max_tokens": "64"}),
        r'"max_tokens" must be a positive integer',
    ),
    (
        jline({"prompt": "a", "output_len": 2.5}),
        r'"output_len" must be a positive integer',
    ),
    (
        jline({"prompt": "a", "output_len": True}),
        r'"output_len" must be a positive integer',
    ),
    (
        jline({"prompt": "a", "id": ""}),
        r'"id" must be a non-empty string or an integer',
    ),
    (
        jline({"prompt": "a", "id": ["x"]}),
        r'"id" must be a non-empty string or an integer',
    ),
    (
        '["not", "an", "object"]',
        r'expected a JSON object, got list.*write e\.g\. \{"prompt": "\.\.\."\}',
    ),
    (
        jline({"prompt": "dup", "id": "good"}),
        r'duplicate id "good" \(first used on line 1\); give every line a unique id',
    ),
]


@pytest.mark.parametrize(("bad_line", "message"), MALFORMED)
def test_jsonl_malformed_line_names_file_line_and_fix(tmp_path, bad_line, message):
    lines = [
        jline({"id": "good", "prompt": "fine"}),
        "",
        jline({"prompt": "also fine"}),
        bad_line,
    ]
    path = write_jsonl(tmp_path / "x.jsonl", lines)
    with pytest.raises(ValueError, match=message) as err:
        load_prompts(path)
    assert str(err.value).startswith(f"{path} line 4: ")


def test_jsonl_lines_after_first_n_are_not_read(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [jline({"prompt": "fine"}), "{broken"])
    assert len(load_prompts(path, num_prompts=1)) == 1
    with pytest.raises(ValueError, match="line 2"):
        load_prompts(path)


# --- files that are neither format ------------------------------------------------------


def test_missing_file_raises_file_not_found_with_path(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=re.escape(str(path))):
        load_prompts(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("prompt,id\nhello,1\n", "unrecognised prompt file format"),
        ("", "file is empty"),
        ("  \n\n", "file is empty"),
        (
            '{\n  "prompts": ["a", "b"]\n}\n',
            "single JSON object spread over several lines",
        ),
    ],
)
def test_unrecognised_format_lists_accepted_formats(tmp_path, content, message):
    path = tmp_path / "data.txt"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message) as err:
        load_prompts(path)
    assert "accepted formats: a ShareGPT JSON list" in str(err.value)
    assert "JSON Lines" in str(err.value)


def test_non_utf8_file(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        load_prompts(path)


@pytest.mark.parametrize(
    ("bad", "error"),
    [(-1, ValueError), (1.5, TypeError), (True, TypeError), ("3", TypeError)],
)
def test_bad_num_prompts(tmp_path, bad, error):
    path = write_jsonl(tmp_path / "p.jsonl", [jline({"prompt": "x"})])
    with pytest.raises(error, match="num_prompts"):
        load_prompts(path, num_prompts=bad)


# --- asking for more prompts than there are --------------------------------------------


def test_asking_for_more_prompts_than_the_dataset_has_warns(tmp_path, caplog):
    """`workbench run --num-prompts 100` on the 74 default prompts runs 74 and says so."""
    with caplog.at_level(logging.WARNING, logger="workbench.bench.datasets"):
        recs, warning = select_prompts(100)
    assert len(recs) == 74
    assert warning == "asked for 100 prompts; the dataset datasets/default_prompts.jsonl has 74 — running 74"
    assert [r.getMessage() for r in caplog.records] == [warning]
    f = write_jsonl(tmp_path / "two.jsonl", [jline({"prompt": "a"}), jline({"prompt": "b"})])
    recs, warning = select_prompts(5, dataset=f)
    assert [r.prompt for r in recs] == ["a", "b"]
    assert warning == f"asked for 5 prompts; the dataset {f} has 2 — running 2"
    recs, warning = select_prompts(3, records=recs)
    assert len(recs) == 2 and warning == "asked for 3 prompts; the records given have 2 — running 2"
    # enough prompts, or all of them asked for: no warning
    caplog.clear()
    assert select_prompts(74)[1] is None and select_prompts(None)[1] is None and select_prompts(2, dataset=f)[1] is None
    assert len(select_prompts(None)[0]) == 74 and not caplog.records
    with pytest.raises(ValueError, match="either dataset or records"):
        select_prompts(2, dataset=f, records=recs)

"""What a request brings in: prompts (text, token ids, chat messages, vLLM's prompt dicts) turned
into token ids, checked before anything is queued."""

from __future__ import annotations

import numbers

#: A prompt: text (no template), token ids, chat messages ``[{"role", "content"}]`` (the model's chat
#: template is applied), or vLLM's dicts ``{"prompt": str}`` (TextPrompt) / ``{"prompt_token_ids": [...]}``
#: (TokensPrompt).
Prompt = str | list[int] | list[dict] | dict

_FORMS = (
    "a string, a list of token ids, chat messages [{'role', 'content'}], {'prompt': str} or "
    "{'prompt_token_ids': [int, ...]}"
)


def _is_scalar(x) -> bool:
    return not isinstance(x, (str, dict, list, tuple))


def as_prompt_list(prompts) -> list:
    """``LLM.generate``'s ``prompts``: one prompt (of any :data:`Prompt` form) or a list of them, as a list.

    A list whose first item is a scalar (an int, or a wrong type the token-id check then names) is one
    token-id prompt; a list whose first item is a chat message (a dict with ``"role"``) is one conversation.

    Raises:
        TypeError: ``prompts`` is none of these forms (e.g. ``123`` or ``None``).
    """
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts={prompts!r} is not a prompt: give {_FORMS}, or a list of them")
    if prompts and (_is_scalar(prompts[0]) or (isinstance(prompts[0], dict) and "role" in prompts[0])):
        return [prompts]
    return list(prompts)


def check_token_ids(ids, vocab_size: int) -> list[int]:
    """``ids`` as a list of ints, each an integer (not a ``bool``, float or string: nothing is coerced)
    in ``[0, vocab_size)``.

    Raises:
        ValueError: an empty list, or a token id of the wrong type or outside the vocabulary (named).
        TypeError: ``ids`` is not a list or tuple.
    """
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"prompt_token_ids={ids!r} must be a list of token ids (integers)")
    if not ids:
        raise ValueError("prompt is empty; give at least one character or token id")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(
                f"token id {t!r} ({type(t).__name__}) is not an integer; token ids must be integers in [0, {vocab_size})"
            )
        if not 0 <= t < vocab_size:
            raise ValueError(f"token id {t} is outside the vocabulary [0, {vocab_size}); fix the prompt's token ids")
    return [int(t) for t in ids]


def tokenize_prompt(
    tokenizer, vocab_size: int, prompt: Prompt, add_generation_prompt: bool = True
) -> tuple[list[int], str | None]:
    """Token ids (and text, ``None`` for token ids) of a prompt; chat messages get the model's chat template
    (ending with the assistant's turn opened unless ``add_generation_prompt=False``).

    Raises:
        ValueError: an empty prompt, text with no tokenizer available, text that is not valid Unicode (a
            lone surrogate), a bad token id (see :func:`check_token_ids`), or a dict with neither
            ``"prompt"`` nor ``"prompt_token_ids"``.
        TypeError: a prompt of none of the :data:`Prompt` forms.
    """
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            return check_token_ids(prompt["prompt_token_ids"], vocab_size), text if isinstance(text, str) else None
        if "prompt" not in prompt:
            raise ValueError(f"prompt dict {prompt!r} has neither 'prompt' (text) nor 'prompt_token_ids'")
        if not isinstance(prompt["prompt"], str):
            raise TypeError(f"prompt dict's 'prompt' must be a string, not {prompt['prompt']!r}")
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty; give at least one character or token id")
        if tokenizer is None:
            raise ValueError("this model folder has no tokenizer: pass prompts as token-id lists")
        _check_unicode(prompt, "prompt")
        return tokenizer.encode(prompt, add_special_tokens=True), prompt
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(f"prompt {prompt!r} is not a prompt: give {_FORMS}")
    if prompt and isinstance(prompt[0], dict):
        messages = chat_messages(prompt)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat messages need a tokenizer with a chat template; pass a plain string")
        for i, m in enumerate(messages):
            _check_unicode(m["content"], f"messages[{i}].content")
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # the template's own check (e.g. roles out of order): the caller's input
            raise ValueError(f"the model's chat template refused these messages: {type(e).__name__}: {e}") from None
        return tokenizer.encode(text, add_special_tokens=False), text
    return check_token_ids(prompt, vocab_size), None


def _check_unicode(text: str, where: str) -> None:
    """Raise ``ValueError`` when ``text`` holds a lone UTF-16 surrogate (not text: no tokenizer takes it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{where} holds a lone UTF-16 surrogate at character {e.start} ({text[e.start]!r}); send valid Unicode"
        ) from None


def chat_messages(messages) -> list[dict]:
    """Chat messages as the chat template takes them: ``{"role": str, "content": str}`` each, with
    OpenAI's content parts (``[{"type": "text", "text": str}, ...]``) joined and ``None`` content
    (an assistant turn without text) as ``""``.

    Raises:
        ValueError: a message that is not a dict with a string ``role``, or content that is not a string,
            ``None`` or a list of text parts with string ``text``; the message names where
            (``messages[i].content[j].text``).
    """
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f"messages[{i}]={m!r} must be a dict with a string 'role' and a 'content'")
        content = m["content"]
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ValueError(f"messages[{i}].content[{j}]: only text content parts are supported (type 'text')")
                if not isinstance(part.get("text"), str):
                    raise ValueError(
                        f"messages[{i}].content[{j}].text={part.get('text')!r} must be a string (a text part's text)"
                    )
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content={content!r} must be a string, a list of text parts, or null")
        out.append({**m, "content": content})
    return out


def max_prompt_chars(tokenizer, max_model_len: int) -> int | None:
    """The most characters a text prompt can have and still fit ``max_model_len`` tokens, or ``None``
    when that cannot be bounded (no tokenizer, or one with a normalizer, which may drop characters).

    No token covers more characters than its vocabulary entry has (byte-level BPE writes a byte per
    character), so a text longer than ``max_model_len`` times the longest entry has more tokens than
    ``max_model_len``: it can be refused before it is tokenized, whose time grows with its length.
    """
    if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    return max_model_len * max(len(t) for t in tokenizer.get_vocab())


def prompt_refusal(n: int, max_model_len: int, pool_tokens: int) -> str | None:
    """Why a prompt of ``n`` tokens can never run on an engine with ``max_model_len`` and a KV pool of
    ``pool_tokens`` slots (the error its request ends with), or ``None``."""
    if n >= max_model_len:
        return (
            f"prompt has {n} tokens but max_model_len={max_model_len} leaves room for at most "
            f"{max_model_len - 1} prompt tokens (one is needed for the output); shorten the prompt "
            "or raise max_model_len"
        )
    if n + 1 > pool_tokens:
        return (
            f"prompt has {n} tokens but the KV pool holds {pool_tokens} tokens; shorten the prompt "
            "or give the KV cache more memory"
        )
    return None


def check_samplable(sp, max_num_seqs: int, vocab_size: int, eos_token_id: int | None) -> None:
    """Refuse :class:`~workbench.sampling_params.SamplingParams` an engine can never run, whatever the
    prompt: more sequences (``n``) than ``max_num_seqs`` (they run side by side; vLLM's server has the same
    bound), or a ``min_tokens`` mask that covers the whole vocabulary (no token could be sampled).

    Raises:
        ValueError: naming the field, the bound and the fix.
    """
    if sp.n > max_num_seqs:
        raise ValueError(
            f"n={sp.n} exceeds max_num_seqs={max_num_seqs}: a request's n sequences run side by side; "
            f"use n <= {max_num_seqs} (or a larger max_num_seqs)"
        )
    if sp.min_tokens == 0:
        return
    banned = {t for t in sp.stop_token_ids if t < vocab_size}
    if not sp.ignore_eos and eos_token_id is not None:
        banned.add(eos_token_id)
    if len(banned) >= vocab_size:
        raise ValueError(
            f"min_tokens={sp.min_tokens} masks stop_token_ids and EOS, which here cover all {vocab_size} tokens of "
            "the vocabulary, so no token could be sampled; list fewer stop_token_ids or set min_tokens=0"
        )


def check_true_output_len(value, name: str = "true_output_len") -> None:
    """Refuse a request's true output length that is not ``None`` or an int >= 1 (tokens).

    A true output length replays a trace: the request ends there as if its model had emitted EOS
    (:meth:`workbench.engine.LLMEngine.add_request`). vLLM has no such argument: its requests end where
    the model decides; a trace replay needs the trace's lengths.

    Raises:
        ValueError: ``value`` is a bool, a non-integer (e.g. ``12.5`` or ``"12"``) or below 1; naming it and the fix.
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}={value!r} is not an int; give the output length in tokens (an int >= 1), or None")
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1 token (a request produces at least one token), or None")

"""What a request brings in: prompts (text, token ids, chat messages) turned into token ids,
checked before anything is queued."""

from __future__ import annotations

#: A prompt: text (no template), token ids, or chat messages ``[{"role", "content"}]``
#: (the model's chat template is applied).
Prompt = str | list[int] | list[dict]


def tokenize_prompt(tokenizer, vocab_size: int, prompt: Prompt) -> tuple[list[int], str | None]:
    """Token ids (and text, ``None`` for token ids) of a prompt; chat messages get the model's chat template.

    Raises:
        ValueError: an empty prompt, text with no tokenizer available, or a token id outside
            ``[0, vocab_size)``.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty; give at least one character or token id")
        if tokenizer is None:
            raise ValueError("this model folder has no tokenizer: pass prompts as token-id lists")
        return tokenizer.encode(prompt, add_special_tokens=True), prompt
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat messages need a tokenizer with a chat template; pass a plain string")
        text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False), text
    ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("prompt is empty; give at least one character or token id")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size}); fix the prompt's token ids")
    return ids, None

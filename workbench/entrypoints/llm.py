"""Offline batch inference over :class:`~workbench.engine.LLMEngine`, as vLLM's ``LLM``
(vllm/entrypoints/llm.py).

from workbench import LLM, SamplingParams
llm = LLM(block_size=16, max_num_seqs=32)          # the bundled SmolLM2-135M
out = llm.generate(["Hello"], SamplingParams(max_tokens=32))
print(out[0].outputs[0].text)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from workbench.config import EngineConfig
from workbench.engine import LLMEngine
from workbench.inputs import Prompt, as_prompt_list, check_true_output_len
from workbench.metrics import Recorder
from workbench.outputs import RequestOutput
from workbench.sampling import SamplingParams


class LLM:
    """Offline batch inference, as vLLM's ``LLM``.

    Args:
        model: see :class:`EngineConfig` (default: the bundled SmolLM2-135M-Instruct).
        **engine_args: any :class:`EngineConfig` field, with vLLM's names.

    Raises:
        ValueError / FileNotFoundError: a bad engine argument, before the model loads.
    """

    def __init__(self, model: str | None = None, recorder: Recorder | None = None, **engine_args) -> None:
        if model is not None:
            engine_args["model"] = model
        unknown = set(engine_args) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown engine argument(s) {sorted(unknown)}; valid ones: "
                f"{sorted(k for k in EngineConfig.__dataclass_fields__ if k != 'extra')}"
            )
        self.llm_engine = LLMEngine(EngineConfig(**engine_args), recorder=recorder)

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def shutdown(self) -> None:
        """Stop tensor-parallel workers (see :meth:`LLMEngine.shutdown`)."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable = False,
        priority: Sequence[int] | None = None,
        true_output_lens: Sequence[int | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched by the engine; outputs come in the prompts' order.

        Args:
            prompts: one prompt or a list: strings, token-id lists, chat message lists, or vLLM's
                ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}`` dicts.
            sampling_params: one for all, or one per prompt.
            use_tqdm: show progress bars of finished requests and of tokens processed (prefill and
                decode; :mod:`workbench.entrypoints.progress`), or a tqdm-like factory to make them with.
            priority: one per prompt (lower = sooner) under ``scheduling_policy="priority"``.
            true_output_lens: one true output length (tokens, or ``None``) per prompt, to replay a trace:
                each request ends there with ``finish_reason="stop"`` unless ``max_tokens`` ends it first,
                whatever the allocator; ``kv_allocator="orca-oracle"`` / ``"orca-pow2"`` reserve by it and
                need it (see :meth:`LLMEngine.add_request`). vLLM has no such argument (its model decides).

        Raises:
            ValueError: an empty prompt, a bad token id, a bad sampling parameter, a true output length
                that is not an int >= 1, or a mismatched number of sampling params or lengths; TypeError: something that is not a prompt (``123``, ``None``)
                or not a ``SamplingParams``. All are raised before any request is queued, so nothing is lost.
        """
        prompts = as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        sps = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(sps) != len(prompts):
            raise ValueError(f"{len(sps)} sampling params for {len(prompts)} prompts; give one, or one per prompt")
        for sp in sps:  # validate all before queueing any
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params holds {sp!r}; give SamplingParams objects")
            sp.verify()
            self.llm_engine.check_samplable(sp)
        eng = self.llm_engine
        tokenized = [eng.tokenize(p) for p in prompts]
        base = eng._counter
        ids = [f"gen-{base + i}" for i in range(len(prompts))]
        clash = [i for i, sp in zip(ids, sps) if eng._id_in_use(i, sp.n)]
        if clash:
            raise ValueError(
                f"request id {clash[0]!r} is already in the engine (added with add_request); use other ids"
            )
        prios = list(priority) if priority is not None else [0] * len(prompts)
        if len(prios) != len(prompts):
            raise ValueError(f"{len(prios)} priorities for {len(prompts)} prompts; give one per prompt")
        if any(prios) and eng.config.scheduling_policy != "priority":
            raise ValueError(
                f"priority is given but scheduling_policy={eng.config.scheduling_policy!r} ignores it; "
                "create the LLM with scheduling_policy='priority'"
            )
        lens = list(true_output_lens) if true_output_lens is not None else [None] * len(prompts)
        if len(lens) != len(prompts):
            raise ValueError(f"{len(lens)} true output lengths for {len(prompts)} prompts; give one per prompt")
        for i, n in enumerate(lens):
            check_true_output_len(n, f"true_output_lens[{i}]")
        if eng.config.kv_allocator in ("orca-oracle", "orca-pow2") and None in lens:
            raise ValueError(
                f"kv_allocator={eng.config.kv_allocator!r} needs each prompt's true output length: pass "
                "true_output_lens (e.g. from a kv_allocator='paged' run), or use kv_allocator='orca-max'"
            )
        added = []
        results: dict[str, RequestOutput] = {}
        rec = eng.recorder
        try:
            for rid, p, sp, tok, pr, n in zip(ids, prompts, sps, tokenized, prios, lens):
                eng.add_request(rid, p, sp, tokenized=tok, priority=pr, true_output_len=n)
                added.append(rid)
            bar = None
            if use_tqdm:
                from tqdm.auto import tqdm

                from workbench.entrypoints.progress import GenerateProgress, remaining_tokens

                bar = GenerateProgress(
                    use_tqdm if callable(use_tqdm) else tqdm, len(ids), lambda: remaining_tokens(eng.scheduler)
                )
            while eng.has_unfinished_requests():
                seen = len(rec.steps)
                finished = eng.step()
                for o in finished:
                    results[o.request_id] = o
                if bar is not None:
                    bar.update(finished, rec.steps[-1] if len(rec.steps) > seen else None)
        except BaseException:  # refused, interrupted, or an error no request can be blamed for: none stays queued
            for rid in added:
                eng.abort(rid)
            raise
        if bar is not None:
            bar.close(rec.steps[-1] if rec.steps else None)
        return [results[i] for i in ids]

    def chat(self, messages, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for one conversation or a list of them (chat template applied).

        Raises:
            TypeError: ``messages`` is not a list of ``{"role", "content"}`` dicts (or a list of such lists).
        """
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, (dict, list, tuple)) for m in messages):
            raise TypeError(
                f"messages={messages!r:.80} must be chat messages [{{'role': ..., 'content': ...}}] or a list of them"
            )
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        return self.generate(list(messages), sampling_params, use_tqdm=use_tqdm)


__all__ = ["LLM"]

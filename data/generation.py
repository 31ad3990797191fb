"""How self-distillation generates: the settings a run is bound to, the stop tokens, and the two generators (one
batch of prompts -> token rows): transformers' `generate` with a per-row seeded sampler, and a vLLM worker
(`data.engines`). `data.selfdistill` drives them."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import (
    AutoConfig,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
)


class SelfDistillError(ValueError):
    """A self-distillation that cannot run or continue; the message names the file, record or option."""


@dataclass(frozen=True)
class GenerationSettings:
    """Everything that determines the output; a resumed run must match it exactly."""

    prompts: str
    """sha256 of the prompts file's records (ids and content); --limit is not part of it: a larger limit continues a
    run (the first batches are the same), a smaller one leaves the records already made."""
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    dtype: str
    batch_size: int
    """Part of the output: a batch's padding changes bf16 numerics, so batches are fixed by the prompt list."""
    engine: str = "hf"
    """"hf" (transformers' `generate`) or "vllm" (`vllm.LLM.generate`, data/engines.py). Settings recorded before
    there was a choice have no `engine`: they were made with "hf". Records say it only when it is not "hf", so the
    HF engine's records are what they were before."""


def record_settings(settings: GenerationSettings) -> dict[str, Any]:
    """The settings a record's `generation` holds: all of them, `engine` only when it is not "hf"."""
    out = asdict(settings)
    if out.get("engine") == "hf":
        del out["engine"]
    return out


def stop_token_ids(eos: int | list[int] | None, tokenizer, extra_stop_ids: list[int] = ()) -> list[int]:
    """Where generation stops: the generation config's EOS tokens, the tokenizer's, `extra_stop_ids` and `<|end|>`
    when the vocabulary has it."""
    stop = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id} | set(extra_stop_ids)
    if "<|end|>" in tokenizer.get_vocab():
        stop.add(tokenizer.convert_tokens_to_ids("<|end|>"))
    stop_ids = sorted(i for i in stop if i is not None)
    if not stop_ids:
        raise SelfDistillError("the target has no EOS token to stop generation at")
    return stop_ids


def finish(row: list[int], stop_ids: list[int], tokenizer) -> tuple[str, str, list[int]]:
    """(text without the stop token, "stop" | "length", the ids up to and with the first stop token) of a
    generated row (an HF row runs on with padding after its stop token)."""
    stop_at = next((k for k, t in enumerate(row) if t in stop_ids), None)
    new = row if stop_at is None else row[:stop_at]
    text = tokenizer.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return text, "length" if stop_at is None else "stop", row if stop_at is None else row[: stop_at + 1]


class PerRowSampler(LogitsProcessor):
    """Samples each row from its own generator and leaves only that token finite, so greedy
    decoding inside `generate` emits it: the samples do not depend on the batch composition."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float):
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        probs = torch.softmax(scores.float().cpu() / self.temperature, dim=-1)  # (B, V)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        sorted_probs[(sorted_probs.cumsum(-1) - sorted_probs) >= self.top_p] = 0
        picks = [
            int(order[i, torch.multinomial(p, 1, generator=g)])
            for i, (p, g) in enumerate(zip(sorted_probs, self.generators))
        ]
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(len(picks)), torch.tensor(picks, device=scores.device)] = 0
        return out


class Generator:
    """Batched left-padded generation with one target, returning text and finish reason per input."""

    def __init__(self, model, tokenizer, settings: GenerationSettings, extra_stop_ids: list[int] = ()):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.stop_ids = stop_token_ids(model.generation_config.eos_token_id, tokenizer, extra_stop_ids)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        # Replacing the target's own generation config keeps its defaults (repetition penalty, sampling,
        # ...) out: `generate` fills every field we leave unset from the model's config.
        model.generation_config = GenerationConfig(
            max_new_tokens=settings.max_new_tokens, do_sample=False, eos_token_id=self.stop_ids, pad_token_id=pad
        )

    @torch.no_grad()
    def __call__(self, inputs: list[list[int]], seeds: list[int]) -> list[tuple[str, str, list[int]]]:
        """(text without the stop token, "stop" | "length", generated ids with the stop token) per input."""
        width = max(map(len, inputs))
        pad = self.model.generation_config.pad_token_id
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in inputs], device=self.model.device)  # (B, T)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in inputs], device=self.model.device)
        processors = LogitsProcessorList()
        if self.settings.temperature > 0:
            processors.append(PerRowSampler(seeds, self.settings.temperature, self.settings.top_p))
        out = self.model.generate(input_ids=ids, attention_mask=mask, logits_processor=processors)
        return [finish(row, self.stop_ids, self.tokenizer) for row in out[:, width:].tolist()]


def target_eos(target: str, trust_remote_code: bool = False) -> int | list[int] | None:
    """The EOS token(s) of the generation config transformers gives the target when it loads the model (its
    generation_config.json, else its config), without loading the weights."""
    try:
        return GenerationConfig.from_pretrained(target).eos_token_id
    except OSError:  # no generation_config.json
        config = AutoConfig.from_pretrained(target, trust_remote_code=trust_remote_code)
        return GenerationConfig.from_model_config(config).eos_token_id


class VllmGenerator:
    """`Generator`'s interface over vLLM's `LLM.generate` (a `data.engines.VllmEngine` worker): the same inputs,
    stop tokens and results, from the token ids vLLM generated. Sampled rows use vLLM's per-request seeds."""

    def __init__(self, engine, tokenizer, settings: GenerationSettings, stop_ids: list[int]):
        self.engine, self.tokenizer, self.settings, self.stop_ids = engine, tokenizer, settings, stop_ids
        self.max_model_len = int(engine.info["max_model_len"])

    def __call__(self, inputs: list[list[int]], seeds: list[int]) -> list[tuple[str, str, list[int]]]:
        n = self.settings.max_new_tokens
        longest = max(map(len, inputs))
        if longest + n > self.max_model_len:
            raise SelfDistillError(
                f"an input of {longest} tokens and --max-new-tokens {n} do not fit vLLM's max_model_len "
                f"{self.max_model_len} (the target's context)"
            )
        rows = self.engine.generate(
            inputs, seeds, n, self.settings.temperature, self.settings.top_p, list(self.stop_ids)
        )
        results = [finish(row, self.stop_ids, self.tokenizer) for row in rows]
        for row, (_, reason, ids) in zip(rows, results):
            if len(ids) != len(row) or (reason == "length" and len(row) != n):
                raise SelfDistillError(
                    f"vLLM returned {len(row)} tokens for --max-new-tokens {n}, "
                    + ("past a stop token" if len(ids) != len(row) else "without a stop token")
                )
        return results

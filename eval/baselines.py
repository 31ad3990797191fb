"""What speculative decoding is measured and checked against: plain decoding and transformers' prompt lookup.

    results = plain_generate_batch(model, prompts, settings, seeds)     # B prompts ((L_b,) ids), any B
    out = plain_generate(model, prompt_ids, settings)                   # one (1, L) prompt: a batch of one
    tokens, seconds = prompt_lookup_generate(model, prompt_ids, settings)

Plain decoding has one path at every batch size: left-padded batched decoding with the model's own attention and a
2D padding mask, as batched HF generation does it, one target forward per token. It shares none of the speculative
loop's target-side code (`eval.target_runner.TargetRunner`: prefill, tree masks, tree kernels, KV commits), so the
greedy losslessness check does not test that code against itself; only the settings / result types and the input
check (`eval.decode`), the clock and two KV-cache utilities (the model's cache argument name, dropping finished rows:
`eval.target_runner`) are shared.
Sampled rows draw from `eval.reference.target_probs`, the processed target distribution that sampled verification
follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig
from transformers.cache_utils import DynamicLayer

from eval.decode import DecodeSettings, GenerationResult, PositionCoins, check_prompts, sample_next
from eval.target_runner import cache_arg, clock, select_cache_rows

PROMPT_LOOKUP_TOKENS = 10
"""Prompt lookup's `prompt_lookup_num_tokens`: the n-gram draft length (transformers' suggested value)."""


@torch.inference_mode()
def plain_generate(model: torch.nn.Module, prompt_ids: torch.Tensor, settings: DecodeSettings) -> GenerationResult:
    """Plain autoregressive decoding of one prompt ((1, L) ids), sampling (if at all) with seed `settings.seed`: the
    batch-of-one case of `plain_generate_batch`."""
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1:
        raise ValueError(
            f"prompt_ids must be (1, L), got shape {tuple(prompt_ids.shape)}; batches: plain_generate_batch"
        )
    return plain_generate_batch(model, [prompt_ids[0]], settings, [settings.seed])[0]


@torch.inference_mode()
def plain_generate_batch(
    model: torch.nn.Module,
    prompts: Sequence[torch.Tensor],
    settings: DecodeSettings,
    seeds: Sequence[int] | None = None,
) -> list[GenerationResult]:
    """Plain decoding of B prompts ((L_b,) ids) together: one target forward per token for the whole batch, as
    batched HF generation does it (left padding, a 2D padding mask, the model's own attention; none of the tree
    kernels), rows leaving the batch when they finish. Row b samples its t-th token with the coin of output position t
    drawn from `seeds[b]` (default `settings.seed + b`; `eval.decode.PositionCoins`, as speculative decoding does), so
    every row decodes what it decodes alone with that seed. Times are the batch's."""
    prompts, seeds = check_prompts(prompts, seeds, settings)
    device, lengths = prompts[0].device, [int(p.shape[0]) for p in prompts]
    coins = PositionCoins(seeds, settings, device)
    start = clock(device)
    L = max(lengths)
    pads = [L - n for n in lengths]  # left padding per row
    ids = torch.zeros(len(prompts), L, dtype=torch.long, device=device)
    mask = torch.zeros(len(prompts), L, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, L - lengths[b] :], mask[b, L - lengths[b] :] = p, 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    kwargs = {cache_arg(model): cache, "use_cache": True, "logits_to_keep": 1}
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs).logits[:, -1].to(device)
    results = [GenerationResult(tokens=[]) for _ in prompts]
    active, next_pos = list(range(len(prompts))), torch.tensor(lengths, device=device)
    while True:
        toks = sample_next(logits, settings, coins.at(active, [len(results[b].tokens) for b in active]))
        new = toks.tolist()
        still = [i for i, b in enumerate(active) if not _append(results[b].tokens, new[i], settings)]
        if not still:
            break
        if len(still) < len(active):
            select_cache_rows(cache, still)
            keep = torch.tensor(still, device=device)
            toks, mask, next_pos, active = toks[keep], mask[keep], next_pos[keep], [active[i] for i in still]
            pads = [pads[i] for i in still]
            full = all(type(layer) is DynamicLayer for layer in cache.layers)  # not sliding-window layers
            if full and min(pads) > 0:  # padding columns no remaining row needs (positions are explicit)
                cut = min(pads)
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys[:, :, cut:], layer.values[:, :, cut:]
                mask, pads = mask[:, cut:], [pad - cut for pad in pads]
        mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
        logits = model(input_ids=toks[:, None], attention_mask=mask, position_ids=next_pos[:, None], **kwargs).logits
        logits, next_pos = logits[:, -1].to(device), next_pos + 1
    wall = clock(device) - start
    for result in results:
        result.target_forwards, result.wall_s, result.target_s = len(result.tokens), wall, wall
    return results


def _append(generated: list[int], token: int, settings: DecodeSettings) -> bool:
    """Append `token`; True when the row is done (a stop token, or max_new_tokens)."""
    generated.append(token)
    return token in settings.eos_token_ids or len(generated) >= settings.max_new_tokens


@torch.inference_mode()
def prompt_lookup_generate(model, ids: torch.Tensor, settings: DecodeSettings) -> tuple[list[int], float]:
    """transformers' prompt-lookup decoding of one prompt ((1, L) ids): `generate` with n-gram drafts copied from the
    context (`PROMPT_LOOKUP_TOKENS` long), what a user gets without training a drafter. Sampled runs seed torch's
    global generator with `settings.seed`. -> (new tokens, the stop token included; seconds)."""
    kwargs: dict[str, Any] = {"do_sample": False}
    if not settings.greedy:
        kwargs = {"do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p, "top_k": 0}
        torch.manual_seed(settings.seed)
    # only these settings: nothing of the model's own generation_config (a repetition penalty, a minimum length,
    # other stop tokens) may make it decode under other rules than plain and speculative decoding
    config = GenerationConfig(
        max_new_tokens=settings.max_new_tokens,
        eos_token_id=settings.eos_token_ids or None,
        pad_token_id=(settings.eos_token_ids or [0])[0],
        prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS,
        **kwargs,
    )
    own, model.generation_config = model.generation_config, GenerationConfig()  # generate fills unset fields from it
    try:
        start = clock(ids.device)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    finally:
        model.generation_config = own
    return out[0, ids.shape[1] :].tolist(), clock(ids.device) - start

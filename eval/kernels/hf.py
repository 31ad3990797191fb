"""Tree attention inside a transformers model: an attention function registered with transformers'
AttentionInterface that runs the Triton `tree_attention` on tree blocks, and the context that hands it the tree.

    name = register_tree_attention()   # then model.set_attn_implementation(name)
    with tree_context(tree.mask_bits):
        logits = model(input_ids=tree_tokens, position_ids=tree.positions(prefix_len)[None], cache=cache).logits
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from eval.kernels.attention import tree_attention

_TREE_MASK: ContextVar[tuple[torch.Tensor, torch.Tensor | None] | None] = ContextVar("specdraft_tree", default=None)


@contextmanager
def tree_context(mask_bits: torch.Tensor, prefix_lens: torch.Tensor | None = None) -> Iterator[None]:
    """Within the block, attention functions registered by `register_tree_attention` treat a query block of N tokens
    as a tree with these (N, W) or (B, N, W) ancestor bits over the last N cached keys; with `prefix_lens` (B,),
    row b sees only the first prefix_lens[b] keys before them (a ragged batch), else all of them."""
    token = _TREE_MASK.set((mask_bits, prefix_lens))
    try:
        yield
    finally:
        _TREE_MASK.reset(token)


def unsupported_attention(module: torch.nn.Module, keys: int, kwargs: dict) -> str | None:
    """What of a transformers attention call the tree kernel would silently get wrong: logit soft-capping (Gemma-2),
    a sliding window the keys reach past (Mistral, Gemma-3 local layers), attention sinks (gpt-oss); None if nothing."""
    if kwargs.get("softcap"):
        return f"logit soft-capping (softcap={kwargs['softcap']})"
    window = kwargs.get("sliding_window")
    if window and keys > window:
        return f"a sliding window of {window} keys ({keys} keys here)"
    if getattr(module, "sinks", None) is not None:
        return "attention sinks"
    return None


TREE_ATTENTION = "specdraft_tree"
"""The attention implementation name `register_tree_attention` registers with transformers."""


def register_tree_attention() -> str:
    """Register `TREE_ATTENTION` with transformers' AttentionInterface (and the sdpa mask builder) and return it.

    Then `model.set_attn_implementation(name)`. Inside `tree_context(mask_bits, prefix_lens)` a query block whose
    length matches the tree runs the Triton `tree_attention` over keys split as [cached prefix | N tree keys]; the
    prefix is visible up to `prefix_lens` (all of it by default), so the HF attention mask is ignored there. Anything
    else (prefill, plain decoding) is SDPA under the HF mask (causal, or a 4D mask passed to the model). The reference
    path needs no registration: it passes an additive 4D tree mask to the model's own attention.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def tree_attention_forward(
        module: torch.nn.Module,
        query: torch.Tensor,  # (B, H, N, D)
        key: torch.Tensor,  # (B, Hkv, P + N, D), cache already appended
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        bits, lens = _TREE_MASK.get() or (None, None)
        n = query.shape[2]
        if bits is None or bits.shape[-2] != n:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        unsupported = unsupported_attention(module, key.shape[2], kwargs)
        if unsupported:
            raise ValueError(
                f"tree_attention kernel: the target's attention uses {unsupported}, which the kernel does not compute; "
                "evaluate with eval.kernels=reference (the model's own attention under a tree mask), within any "
                "sliding window"
            )
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = tree_attention(
            query,
            key[:, :, :-n],
            value[:, :, :-n],
            key[:, :, -n:],
            value[:, :, -n:],
            bits.to(query.device),
            scale,
            prefix_lens=None if lens is None else lens.to(query.device),
        )
        return out.transpose(1, 2).contiguous(), None  # (B, N, H, D) like every HF attention function

    AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)
    AttentionMaskInterface.register(TREE_ATTENTION, sdpa_mask)
    return TREE_ATTENTION

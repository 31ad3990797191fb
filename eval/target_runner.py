"""The target as the speculative loop runs it: prefill, then one forward per round over the verified tree (tree
attention through the project's kernels or the model's own attention), its KV cache kept to the accepted path, rows
dropped as they finish; and the timing clock the loop reads."""

from __future__ import annotations

import contextlib
import inspect
import time
from typing import Literal

import torch
from transformers import DynamicCache

from eval import EvalError
from eval.kernels import TreeOps, get_ops, register_tree_attention, tree_context
from eval.trees import Tree

Kernels = Literal["triton", "reference"]
"""Tree attention and KV commit through the Triton kernels, or through their PyTorch twins."""


def sliding_window(model: torch.nn.Module) -> int | None:
    """The smallest sliding window of the model's attention layers (as transformers builds their cache), or None."""
    layers = DynamicCache(config=model.config).layers
    windows = [w for w in (getattr(layer, "sliding_window", None) for layer in layers) if w]
    return min(windows) if windows else None


def clock(device: torch.device | str) -> float:
    """perf_counter after the device's queued work has finished: on a GPU, kernels run asynchronously, and a
    span timed without synchronizing would hold only their launches (their run time landing in the next span)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def tree_attention_mask(
    tree: Tree, prefix_len: int, dtype: torch.dtype, prefix_lens: torch.Tensor | None = None
) -> torch.Tensor:
    """(B or 1, 1, N, prefix_len + N) additive float mask: the cached prefix is visible (row b: only its first
    prefix_lens[b] positions, when given), tree nodes see their ancestors.

    Additive (0 / finfo.min), never bool: eager attention adds a user-supplied 4D mask as-is.
    """
    allowed = tree.dense_mask()  # (N, N) or (B, N, N)
    allowed = allowed if allowed.dim() == 3 else allowed[None]
    n, device = allowed.shape[-1], allowed.device
    seen = torch.ones(allowed.shape[0], prefix_len, dtype=torch.bool, device=device)
    if prefix_lens is not None:
        seen = torch.arange(prefix_len, device=device) < prefix_lens.to(device)[:, None]  # (B, P)
    visible = torch.cat([seen[:, None, :].expand(-1, n, -1), allowed], dim=-1)  # (B, N, P+N)
    return torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]


def cache_arg(model: torch.nn.Module) -> str:
    """The name under which `model.forward` takes its KV cache: transformers renamed `past_key_values` to `cache`
    in 5.x, and an unknown name would be swallowed by **kwargs."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def select_cache_rows(cache: DynamicCache, rows: list[int]) -> None:
    """Keep only these batch rows of every layer (each on its own device under a `device_map`)."""
    index: dict[torch.device, torch.Tensor] = {}
    for layer in cache.layers:
        device = layer.keys.device
        if device not in index:
            index[device] = torch.tensor(rows, dtype=torch.long, device=device)
        layer.keys, layer.values = layer.keys[index[device]], layer.values[index[device]]


class TargetRunner:
    """The frozen target with its KV cache for a batch of rows, as the speculative loop drives it: prefill, tree
    forwards, commits, dropping finished rows; `seconds` = time in forwards.

    Ragged layout: the cache tensors are (B, Hkv, S, D) with S the longest row; row b's first `lengths[b]` positions
    are its tokens and the rest are stale, never attended (tree attention takes per-row prefix lengths). A tree block
    is appended after S for every row, and `commit` moves each row's accepted KV rows to its own prefix end.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        feature_layers: list[int],
        kernels: Kernels = "reference",
        ops: TreeOps | None = None,
    ):
        self.model = model
        self.kernels = kernels
        self.ops = ops or get_ops(kernels)
        self.feature_layers = feature_layers
        self.attn_implementation = model.config._attn_implementation  # restored by `close`
        if kernels == "triton":  # tree blocks through the fused kernel; other blocks stay SDPA
            name = register_tree_attention()
            if model.config._attn_implementation != name:
                model.set_attn_implementation(name)
        # Sliding-window cache layers keep only their last `window` positions, and tree verification, KV commit and
        # the cropping of rejected rows assume every layer holds the whole sequence: such targets get whole-sequence
        # layers and run only within their window, where sliding-window attention is causal attention.
        self.window = sliding_window(model)
        self.cache = DynamicCache() if self.window is not None else DynamicCache(config=model.config)
        self.cache_arg = cache_arg(model)
        self.lengths: list[int] = []  # per row: cached positions that are its own (the rest up to S are stale)
        self.tree_start = 0  # where the last tree block starts in the cache (S before it was appended)
        self.prefix_ends: int | torch.Tensor = 0  # the rows' prefix ends at the last tree: an int unless ragged
        self.forwards = 0
        self.seconds = 0.0

    def _run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None,
        logits_to_keep: int | torch.Tensor,
        context: contextlib.AbstractContextManager,
        start: float,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model forward; `seconds` grows by the time since `start` (building the forward's mask included)."""
        with context:
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                use_cache=True,
                **{self.cache_arg: self.cache},
                output_hidden_states=bool(self.feature_layers),
                logits_to_keep=logits_to_keep,
            )
        hidden, home = None, input_ids.device  # a device_map target ends on another GPU than it starts
        if self.feature_layers:
            hidden = torch.stack([out.hidden_states[i].to(home) for i in self.feature_layers], dim=2)  # (B, N, S, d)
        self.forwards += 1
        self.seconds += clock(home) - start
        return out.logits.to(home), hidden

    def _within_window(self, length: int) -> None:
        if self.window is not None and length > self.window:
            raise EvalError(
                f"the target's sliding-window attention keeps {self.window} positions, this sequence needs {length}: "
                "speculative decoding here keeps whole caches, so sliding-window targets run only within their window "
                "(shorter eval prompts or eval.max_new_tokens)"
            )

    def prefill(self, prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fill the cache with B prompts ((L_b,) ids) -> logits at each prompt's last token (B, V), hidden
        (B, max L_b, S, d) or None. Shorter prompts are right-padded: under the causal mask a real token never sees
        the padding after it, and the padded positions become stale rows that later forwards do not attend to."""
        lengths = [int(p.shape[0]) for p in prompts]
        device = prompts[0].device
        L = max(lengths)
        self._within_window(L)
        ids = torch.zeros(len(prompts), L, dtype=torch.long, device=device)
        for row, p in enumerate(prompts):
            ids[row, : lengths[row]] = p
        positions = torch.arange(L, device=device)[None].expand(len(prompts), -1)
        self.lengths = lengths
        if len(set(lengths)) == 1:
            logits, hidden = self._run(ids, positions, None, 1, contextlib.nullcontext(), clock(device))
            return logits[:, -1], hidden
        # logits only at the distinct last positions ((B, K, V) with K <= B), then each row's own
        last = sorted(set(n - 1 for n in lengths))
        keep = torch.tensor(last)  # on the CPU: transformers indexes the last hidden states with it, and a
        # `device_map` target's last hidden states live on its last GPU (a CPU index is valid on every device)
        logits, hidden = self._run(ids, positions, None, keep, contextlib.nullcontext(), clock(device))
        pick = torch.tensor([last.index(n - 1) for n in lengths], device=device)
        return logits[torch.arange(len(lengths), device=device), pick], hidden

    def verify(self, tree: Tree) -> tuple[torch.Tensor, torch.Tensor | None]:
        """B stacked trees, each after its row's own prefix (positions prefix end + depth) -> logits (B, N, V),
        hidden (B, N, S, d) or None; tree attention sees each row's own prefix only."""
        start = clock(tree.tokens.device)
        self.tree_start = self.cache.get_seq_length()
        self._within_window(self.tree_start + tree.num_nodes)
        ragged = any(length != self.tree_start for length in self.lengths)
        self.prefix_ends = (
            torch.tensor(self.lengths, device=tree.tokens.device, dtype=torch.int32) if ragged else self.tree_start
        )  # one int when every row ends where the cache does
        lens = self.prefix_ends if ragged else None
        mask, context = None, contextlib.nullcontext()
        if self.kernels == "reference":
            mask = tree_attention_mask(tree, self.tree_start, self.model.dtype, lens)
        else:
            context = tree_context(tree.mask_bits, lens)
        return self._run(tree.tokens, tree.positions(self.prefix_ends), mask, 0, context, start)

    def close(self) -> None:
        """Give the model back its own attention implementation (plain baselines must not run through ours)."""
        if self.model.config._attn_implementation != self.attn_implementation:
            self.model.set_attn_implementation(self.attn_implementation)

    def commit(self, accepted_nodes: torch.Tensor, accept_len: list[int]) -> None:
        """After a tree forward: move each row's accepted KV rows (`accepted_nodes` (B, D+1), root first, -1
        padded; `accept_len` drafted nodes accepted per row) from the tree block to the row's prefix end in place
        (`ops.kv_commit`), then crop the cache to the longest row. Not timed as target time: it is the loop's."""
        layers = self.cache.layers
        keys, values = [x.keys for x in layers], [x.values for x in layers]
        ragged = not isinstance(self.prefix_ends, int)  # else every tree block starts at its row's prefix end
        self.ops.kv_commit(keys, values, self.prefix_ends, accepted_nodes, self.tree_start if ragged else None)
        self.lengths = [length + a + 1 for length, a in zip(self.lengths, accept_len)]
        self._crop(max(self.lengths))

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only these batch rows (the others finished decoding) and crop to the longest kept row."""
        if rows == list(range(len(self.lengths))):
            return
        select_cache_rows(self.cache, rows)
        self.lengths = [self.lengths[r] for r in rows]
        self._crop(max(self.lengths, default=0))

    def _crop(self, length: int) -> None:
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]

"""Pure-PyTorch twins that define the semantics of the tree kernels in `eval.kernels`.

Tested by `TRITON_INTERPRET=1 .venv/bin/pytest tests/test_kernels.py -q`.

Conventions shared with the Triton kernels (same signatures; switch with `eval.kernels.get_ops("reference")`):
- Tree tensors come from `eval.trees.Tree` (one tree for the batch, or B stacked trees). The KV rows of the N tree
  tokens sit right after a cached prefix of `prefix_len` tokens; node 0 (the root) is the last verified token.
- Verifiers return `(accept_len (B,), accepted_nodes (B, D+1), bonus (B,))`: `accepted_nodes[:, 0]` is the root,
  then the accepted drafted nodes in path order, -1 padded; `accept_len` counts the accepted drafted nodes (root
  excluded); `bonus` is the token emitted after the last accepted node. A round therefore yields accept_len + 1
  tokens, and `kv_commit(…, accepted_nodes)` keeps accept_len + 1 KV rows.
- Sampled verification takes `coins (B, D+1, C)` uniforms in [0, 1), C >= max children + 1 (see `draw_coins`):
  `coins[:, d, 0]` draws the emitted token at depth d, `coins[:, d, 1 + k]` tests the k-th child at depth d.
"""

from __future__ import annotations

import math

import torch

from eval.trees import Tree, unpack_mask

__all__ = [
    "draw_coins",
    "kv_commit",
    "sample_from",
    "target_probs",
    "tree_attention",
    "verify_greedy",
    "verify_sampled",
    "verify_typical",
]


def tree_attention(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    mask_bits: torch.Tensor,
    scale: float,
    prefix_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (B, H, N, D) attends to the prefix keys (B, Hkv, P, D) and to the tree keys (B, Hkv, N, D) allowed by
    mask_bits (B, N, W). GQA: query head h reads kv head h // (H / Hkv). fp32 math, output in q.dtype.

    `prefix_lens` (B,): row b sees only its first prefix_lens[b] <= P prefix keys (a ragged batch: rows that accepted
    fewer tokens leave stale rows at the end of their prefix); None: every row sees all P."""
    b, h, n, _ = q.shape
    p = k_prefix.shape[2]
    group = h // k_tree.shape[1]
    mask_bits = mask_bits.expand(b, n, mask_bits.shape[-1])
    k = torch.cat([k_prefix, k_tree], dim=2).float().repeat_interleave(group, dim=1)  # (B, H, P+N, D)
    v = torch.cat([v_prefix, v_tree], dim=2).float().repeat_interleave(group, dim=1)
    seen = mask_bits.new_ones(b, p, dtype=torch.bool)
    if prefix_lens is not None:
        seen = torch.arange(p, device=q.device) < prefix_lens.to(q.device)[:, None]  # (B, P)
    visible = torch.cat([seen[:, None, :].expand(b, n, p), unpack_mask(mask_bits, n)], dim=-1)  # (B, N, P+N)
    scores = torch.einsum("bhnd,bhsd->bhns", q.float(), k) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return torch.einsum("bhns,bhsd->bhnd", scores.softmax(-1), v).to(q.dtype)


# ---------------------------------------------------------------------------------------------------- verification


def _longest_accepted(
    ok: torch.Tensor, tree: Tree, tie_score: torch.Tensor | None, dense: torch.Tensor, argmax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deepest node whose whole path is accepted (ok (B, N), root always ok); ties: highest tie_score, then lowest
    node index. Returns (accept_len, accepted_nodes, argmax at the chosen node)."""
    bsz = ok.shape[0]
    depth = tree.depth
    key = torch.where(ok, depth, -1)  # (B, N)
    deepest = key == key.max(-1, keepdim=True).values
    score = torch.zeros_like(ok, dtype=torch.float32) if tie_score is None else tie_score
    best = torch.where(deepest, score, float("-inf")).argmax(-1)  # (B,) first index among equal maxima
    rows = torch.arange(bsz, device=ok.device)
    on_path = dense[rows, best]  # (B, N)
    width = tree.max_depth + 1
    slots = torch.where(on_path, depth, width)  # off-path nodes go to a dump column
    accepted = torch.full((bsz, width + 1), -1, dtype=torch.long, device=ok.device)
    nodes = torch.arange(ok.shape[1], device=ok.device).expand(bsz, -1)
    accepted.scatter_(1, slots, torch.where(on_path, nodes, -1))
    return depth[rows, best], accepted[:, :width], argmax[rows, best]


def verify_greedy(
    tree_tokens: torch.Tensor, target_logits: torch.Tensor, tree: Tree
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy verification: a drafted node is accepted iff its token equals the target argmax at its parent and its
    parent is accepted; the deepest accepted node wins (siblings carry distinct tokens, so the accepted path is
    unique; otherwise the lowest node index). Bonus = target argmax at the last accepted node.

    target_logits: (B, N, V) logits, or (B, N) integer argmax tokens."""
    bsz = tree_tokens.shape[0]
    tree = tree.batched(bsz)
    argmax = target_logits if not target_logits.is_floating_point() else target_logits.argmax(-1)  # (B, N)
    match = tree_tokens == argmax.gather(1, tree.parents.clamp(min=0))
    match[:, 0] = True
    dense = tree.dense_mask()  # (B, N, N)
    ok = ~(dense & ~match[:, None, :]).any(-1)
    return _longest_accepted(ok, tree, None, dense, argmax)


def verify_typical(
    tree_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    tree: Tree,
    epsilon: float = 0.09,
    delta: float = 0.3,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Medusa typical acceptance (LOSSY: the output does not follow the target distribution).

    With p = softmax(logits / temperature) at the parent, a drafted node is accepted iff
    log p(x) > min(log ε, log δ - H(p)) and its parent is accepted. The longest accepted path wins, ties by the summed
    log p along the path (then lowest node index). Bonus = target argmax at the last accepted node."""
    bsz = tree_tokens.shape[0]
    tree = tree.batched(bsz)
    logp = torch.log_softmax(target_logits.float() * (1.0 / temperature), dim=-1)  # (B, N, V); * 1/T as the kernel
    entropy = torch.special.entr(logp.exp()).sum(-1)  # (B, N); 0 * log 0 = 0 for -inf logits
    log_thr = torch.clamp(math.log(delta) - entropy, max=math.log(epsilon))  # (B, N)
    parents = tree.parents.clamp(min=0)
    rows = torch.arange(bsz, device=logp.device)[:, None]
    child_logp = logp[rows, parents, tree_tokens.clamp(min=0)]  # (B, N): log p(token) at the parent
    accept = (child_logp > log_thr.gather(1, parents)) & (tree_tokens >= 0)  # a node without a token (-1): never
    accept[:, 0] = True
    child_logp[:, 0] = 0.0
    dense = tree.dense_mask()
    ok = ~(dense & ~accept[:, None, :]).any(-1)
    path_logp = torch.where(dense, child_logp[:, None, :], 0.0).sum(-1)  # (B, N); a -inf off the path adds nothing
    return _longest_accepted(ok, tree, path_logp, dense, target_logits.argmax(-1))


def target_probs(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """The one processed target distribution (fp32) used for acceptance, residuals and the bonus draw."""
    if temperature <= 0:
        raise ValueError("sampled verification needs temperature > 0; use verify_greedy for temperature 0")
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p  # keep the smallest prefix reaching top_p
        probs = probs.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs (B, V) (unnormalised is fine), coins (B,) in [0, 1) -> tokens (B,)."""
    cdf = probs.cumsum(-1)
    y = torch.searchsorted(cdf, (coins * cdf[:, -1])[:, None].contiguous(), right=True).squeeze(-1)
    return y.clamp(max=probs.shape[-1] - 1)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)): the target mass not yet covered by the rejected draft distribution."""
    r = (p - q).clamp(min=0)
    return r / r.sum(-1, keepdim=True).clamp(min=torch.finfo(r.dtype).tiny)


def max_children(tree: Tree) -> int:
    """The largest number of children of one node (over the batch for stacked trees)."""
    parents = tree.parents.reshape(-1, tree.num_nodes)[:, 1:]
    counts = torch.zeros(parents.shape[0], tree.num_nodes, dtype=torch.long, device=parents.device)
    counts.scatter_add_(1, parents, torch.ones_like(parents))
    return int(counts.max())


def draw_coins(
    tree: Tree, batch_size: int, generator: torch.Generator | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """Fresh uniforms for one sampled verification round: (B, D+1, max children + 1) on `device` (default the
    tree's), drawn on the generator's device."""
    shape = (batch_size, tree.max_depth + 1, max_children(tree) + 1)
    device = tree.parents.device if device is None else device
    return torch.rand(shape, generator=generator, device=device if generator is None else generator.device).to(device)


def verify_sampled(
    tree_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    tree: Tree,
    coins: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless tree verification by rejection sampling; the emitted tokens follow the processed target p exactly.

    Walk from the root; at each node the children are tried in sibling order against the current p (the processed
    target distribution at the node, see `target_probs`):
    - `draft_probs` (B, N, V) given — children were SAMPLED i.i.d. from q = draft_probs[node] (SpecInfer recursive
      rejection, the i.i.d. variant): accept child x iff coin < p(x) / q(x); after a rejection p <- norm(max(p - q, 0))
      and q stays (the next sibling is an independent draw from the same q).
    - `draft_probs` None — children are DETERMINISTIC (top-k) drafts: target-only acceptance. Draw y ~ p with
      coins[:, d, 0]; descend into the first child whose token is y, otherwise stop with y as the bonus. (Equivalent
      in law to testing each child x with prob p(x) and zeroing it from p after a rejection.)
    Stopping at a node (no child accepted, or a leaf) emits the bonus y ~ current p (coins[:, d, 0])."""
    bsz, n = tree_tokens.shape
    tree = tree.batched(bsz)
    p_all = target_probs(target_logits, temperature, top_p)  # (B, N, V)
    rows = torch.arange(bsz, device=tree_tokens.device)
    cur = torch.zeros(bsz, dtype=torch.long, device=tree_tokens.device)
    active = torch.ones(bsz, dtype=torch.bool, device=tree_tokens.device)
    accepted = torch.full((bsz, tree.max_depth + 1), -1, dtype=torch.long, device=tree_tokens.device)
    accepted[:, 0] = 0
    accept_len = torch.zeros_like(cur)
    bonus = torch.full_like(cur, -1)
    for d in range(tree.max_depth + 1):
        p = p_all[rows, cur]  # (B, V)
        child = tree.first_child[rows, cur]  # (B,)
        nxt = torch.full_like(cur, -1)
        if draft_probs is None:
            y = sample_from(p, coins[:, d, 0])
        else:
            q = draft_probs[rows, cur].float()
        k = 0
        while bool((child >= 0).any()):
            live = (child >= 0) & (nxt < 0)
            x = tree_tokens[rows, child.clamp(min=0)]
            if draft_probs is None:
                hit = live & (x == y)
            else:
                px, qx = p.gather(1, x[:, None]).squeeze(1), q.gather(1, x[:, None]).squeeze(1)
                hit = live & (coins[:, d, 1 + k] * qx < px)
                p = torch.where((live & ~hit)[:, None], _residual(p, q), p)
            nxt = torch.where(hit, child, nxt)
            child = torch.where(child >= 0, tree.next_sibling[rows, child.clamp(min=0)], -1)
            k += 1
        if draft_probs is not None:
            y = sample_from(p, coins[:, d, 0])
        stop = active & (nxt < 0)
        bonus = torch.where(stop, y, bonus)
        active = active & ~stop
        if d < tree.max_depth:
            accepted[:, d + 1] = torch.where(active, nxt, -1)
        accept_len = accept_len + active.long()
        cur = torch.where(active, nxt, cur)
        if not bool(active.any()):
            break
    return accept_len, accepted, bonus


# ------------------------------------------------------------------------------------------------------- KV commit


def kv_commit(
    k_cache: torch.Tensor | list[torch.Tensor],
    v_cache: torch.Tensor | list[torch.Tensor],
    prefix_len: int | torch.Tensor,
    accepted_nodes: torch.Tensor,
    tree_start: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Move the KV rows of the accepted nodes (rows tree_start + node) to rows prefix_len, prefix_len + 1, … in place.

    Caches are (B, Hkv, S, D) tensors or per-layer lists of them, on any devices (the layers of a `device_map`
    target); accepted_nodes (B, L) lists nodes in path order, -1 padded at the end. `tree_start` (int or (B,), at
    least prefix_len; default prefix_len) is where the tree block starts: in a ragged batch every row's tree block
    starts after the longest prefix, and shorter rows close the gap. Returns new_len (B,) = prefix_len + number of
    accepted nodes (root included), on accepted_nodes' device; rows past it are stale and the caller crops or masks
    them."""
    bsz, width = accepted_nodes.shape
    device = accepted_nodes.device
    prefix = torch.as_tensor(prefix_len, device=device).expand(bsz)[:, None]  # (B, 1)
    start = prefix if tree_start is None else torch.as_tensor(tree_start, device=device).expand(bsz)[:, None]
    if bool((start < prefix).any()):
        raise ValueError("kv_commit: tree_start must be >= prefix_len (rows move towards the start of the cache)")
    steps = torch.arange(width, device=device)[None, :]
    valid = accepted_nodes >= 0
    dst = prefix + steps  # (B, L)
    src = torch.where(valid, start + accepted_nodes, dst)
    on = {device: (src, dst)}  # the indices on each cache's device (a device_map target: several GPUs)
    for cache in [*_as_list(k_cache), *_as_list(v_cache)]:
        _, h, _, d = cache.shape
        if cache.device not in on:
            on[cache.device] = (src.to(cache.device), dst.to(cache.device))
        cache_src, cache_dst = on[cache.device]
        rows = cache.gather(2, cache_src[:, None, :, None].expand(-1, h, -1, d))  # (B, Hkv, L, D) copy
        cache.scatter_(2, cache_dst[:, None, :, None].expand(-1, h, -1, d), rows)
    return prefix[:, 0] + valid.sum(-1)


def _as_list(cache: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    return [cache] if isinstance(cache, torch.Tensor) else list(cache)

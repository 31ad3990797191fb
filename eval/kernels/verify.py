"""Triton tree verification: which drafted nodes the target accepts, twins of `eval.reference.verify_greedy`,
`verify_typical` and `verify_sampled` (same signatures and outputs, see `eval.reference`).

    accept_len, accepted_nodes, bonus = verify_greedy(tree_tokens, target_logits, tree)
    accept_len, accepted_nodes, bonus = verify_typical(tree_tokens, target_logits, tree, epsilon, delta, temperature)
    accept_len, accepted_nodes, bonus = verify_sampled(tree_tokens, target_logits, tree, coins, draft_probs, t, top_p)

Greedy and typical: one program per (request, node) row takes the argmax / log-sum-exp / entropy over the vocabulary,
then one program per request picks the longest accepted path from the ancestor bitmask. Sampled: one program per
request walks first-child / next-sibling (acceptance tests, residual updates, inverse-CDF draws); only the
temperature / top-p processing of the target logits stays in torch (`reference.target_probs`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from eval import reference
from eval.kernels.launch import INTERPRET, on_first_device
from eval.trees import Tree


@triton.jit
def _row_stats_kernel(
    LOGITS, ARGMAX, LSE, LOG_THR, V, stride_row, inv_temp, log_eps, log_delta,
    TYPICAL: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One program per (b, node) row: argmax (first maximum) and, for typical acceptance, the log-sum-exp of
    logits / T and the threshold min(log eps, log delta - H) in one online pass over the vocabulary."""
    row = tl.program_id(0)
    base = LOGITS + row.to(tl.int64) * stride_row
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)  # sum exp(z - m)
    t = tl.zeros([], tl.float32)  # sum exp(z - m) * z
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, cols < V, float("-inf")).to(tl.float32)
        blk_max, blk_idx = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        better = blk_max > best_val
        best_idx = tl.where(better, start + blk_idx, best_idx)
        best_val = tl.where(better, blk_max, best_val)
        if TYPICAL:
            z = x * inv_temp
            m_new = tl.maximum(m, blk_max * inv_temp)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            e = tl.exp(z - m_safe)  # 0 for padding and -inf logits
            alpha = tl.exp(m - m_safe)
            s = s * alpha + tl.sum(e, 0)
            t = t * alpha + tl.sum(e * tl.where(e > 0, z, 0.0), 0)
            m = m_new
    tl.store(ARGMAX + row, best_idx.to(tl.int64))
    if TYPICAL:
        lse = m + tl.log(s)
        entropy = lse - t / s
        tl.store(LSE + row, lse)
        tl.store(LOG_THR + row, tl.minimum(log_eps, log_delta - entropy))


@triton.jit
def _longest_path_kernel(
    TOKENS, PARENTS, DEPTH, BITS, ARGMAX, LOGITS, LSE, LOG_THR, ACCEPT_LEN, ACCEPTED, BONUS,
    N, V, inv_temp, s_tok, s_par, s_dep, s_bb, s_bn, s_lb, s_ln, s_acc,
    WIDTH: tl.constexpr, TYPICAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """One program per request. A node is accepted iff every node on its root path passes its test (greedy: token
    == argmax at the parent; typical: log p > threshold at the parent), read from the ancestor bitmask; the deepest
    accepted node wins (typical: ties by path log-likelihood), then the lowest index."""
    b = tl.program_id(0)
    i = tl.arange(0, BLOCK_N)
    i_ok = i < N
    par = tl.maximum(tl.load(PARENTS + b * s_par + i, i_ok, 0), 0)
    tok = tl.load(TOKENS + b * s_tok + i, i_ok, 0)
    depth = tl.load(DEPTH + b * s_dep + i, i_ok, 0)
    if TYPICAL:
        known = tok >= 0  # a node without a token (-1) is never accepted
        z = tl.load(LOGITS + b.to(tl.int64) * s_lb + par * s_ln + tl.maximum(tok, 0), i_ok, 0.0).to(tl.float32)
        lp = z * inv_temp - tl.load(LSE + b * N + par, i_ok, 0.0)
        passed = (lp > tl.load(LOG_THR + b * N + par, i_ok, 0.0)) & known
        lp = tl.where(i == 0, 0.0, lp)
    else:
        passed = tok == tl.load(ARGMAX + b * N + par, i_ok, 0)
    failed = (~passed) & (i > 0) & i_ok  # (BLOCK_N,) over ancestors j
    j = tl.arange(0, BLOCK_N)
    words = tl.load(BITS + b * s_bb + i[:, None] * s_bn + j[None, :] // 32, i_ok[:, None] & (j < N)[None, :], 0)
    anc = ((words >> (j[None, :] % 32)) & 1) != 0  # (i, j): j on the root path of i
    ok = (tl.sum(tl.where(anc & failed[None, :], 1, 0), 1) == 0) & i_ok
    key = tl.where(ok, depth, -1)
    cand = key == tl.max(key, 0)
    if TYPICAL:
        path_lp = tl.where(cand, tl.sum(tl.where(anc, lp[None, :], 0.0), 1), float("-inf"))
        cand = cand & (path_lp == tl.max(path_lp, 0))
    best = tl.min(tl.where(cand, i, BLOCK_N), 0)
    on_path = tl.sum(tl.where((i[:, None] == best) & anc, 1, 0), 0) > 0  # (j,)
    slot = tl.arange(0, BLOCK_W)
    hit = on_path[None, :] & (depth[None, :] == slot[:, None])  # (slot, j)
    node_at = tl.sum(tl.where(hit, j[None, :] + 1, 0), 1) - 1
    tl.store(ACCEPTED + b * s_acc + slot, node_at.to(tl.int64), slot < WIDTH)
    tl.store(ACCEPT_LEN + b, tl.max(key, 0).to(tl.int64))
    tl.store(BONUS + b, tl.load(ARGMAX + b * N + best))


def _verify_longest_path(
    tree_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    tree: Tree,
    typical: bool,
    epsilon: float = 0.09,
    delta: float = 0.3,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bsz, n = tree_tokens.shape
    tree = tree.batched(bsz)
    device = tree_tokens.device
    tokens = tree_tokens.contiguous()
    parents, depth, bits = (x.contiguous() for x in (tree.parents, tree.depth, tree.mask_bits))
    if target_logits.is_floating_point():
        logits = target_logits.contiguous()
        vocab = logits.shape[-1]
        argmax = torch.empty(bsz, n, dtype=torch.long, device=device)
        lse = torch.empty(bsz, n, dtype=torch.float32, device=device)
        log_thr = torch.empty_like(lse)
        _row_stats_kernel[(bsz * n,)](
            logits, argmax, lse, log_thr, vocab, logits.stride(1), 1.0 / temperature, math.log(epsilon),
            math.log(delta), TYPICAL=typical, BLOCK_V=64 if INTERPRET else 1024,
        )  # fmt: skip
    else:  # greedy with the argmax already taken
        logits, vocab, lse, log_thr = tokens, 0, tokens, tokens
        argmax = target_logits.long().contiguous()
    width = tree.max_depth + 1
    accept_len = torch.empty(bsz, dtype=torch.long, device=device)
    accepted = torch.empty(bsz, width, dtype=torch.long, device=device)
    bonus = torch.empty(bsz, dtype=torch.long, device=device)
    _longest_path_kernel[(bsz,)](
        tokens, parents, depth, bits, argmax, logits, lse, log_thr, accept_len, accepted, bonus,
        n, vocab, 1.0 / temperature, tokens.stride(0), parents.stride(0), depth.stride(0), bits.stride(0),
        bits.stride(1), logits.stride(0) if typical else 0, logits.stride(1) if typical else 0, accepted.stride(0),
        WIDTH=width, TYPICAL=typical, BLOCK_N=max(16, triton.next_power_of_2(n)),
        BLOCK_W=max(16, triton.next_power_of_2(width)),
    )  # fmt: skip
    return accept_len, accepted, bonus


@on_first_device
def verify_greedy(
    tree_tokens: torch.Tensor, target_logits: torch.Tensor, tree: Tree
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of `eval.reference.verify_greedy` (row argmax kernel + longest-path kernel)."""
    return _verify_longest_path(tree_tokens, target_logits, tree, typical=False)


@on_first_device
def verify_typical(
    tree_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    tree: Tree,
    epsilon: float = 0.09,
    delta: float = 0.3,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of `eval.reference.verify_typical` (LOSSY Medusa typical acceptance)."""
    return _verify_longest_path(tree_tokens, target_logits, tree, True, epsilon, delta, temperature)


@triton.jit
def _row_total(ROW, V, BLOCK_V: tl.constexpr):
    total = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        total += tl.sum(tl.load(ROW + cols, cols < V, 0.0), 0)
    return total


@triton.jit
def _draw(ROW, total, u, V, BLOCK_V: tl.constexpr):
    """Inverse-CDF draw from an unnormalised row: the first index whose running sum exceeds u * total, as
    `eval.reference.sample_from`. If rounding leaves none (the running sum, added in another order than `total`,
    can end a few ulps below it when u is within a few ulps of 1), the last index with mass: never a token of
    probability 0."""
    target = u * total
    carry = tl.zeros([], tl.float32)
    found = tl.full([], V, tl.int32)
    last = tl.zeros([], tl.int32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(ROW + cols, cols < V, 0.0)
        cdf = tl.cumsum(x, 0) + carry
        first = tl.min(tl.where((cdf > target) & (cols < V), cols, V), 0)
        found = tl.minimum(found, first)
        last = tl.maximum(last, tl.max(tl.where((x > 0) & (cols < V), cols, 0), 0))
        carry += tl.sum(x, 0)
    return tl.where(found < V, found, last).to(tl.int64)


@triton.jit
def _sampled_walk_kernel(
    P, Q, RES, TOKENS, FIRST_CHILD, NEXT_SIBLING, COINS, ACCEPT_LEN, ACCEPTED, BONUS,
    N, V, s_tok, s_fc, s_ns, s_cb, s_cd, s_acc,
    SAMPLED: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One program per request walks the tree like `eval.reference.verify_sampled`. P holds the processed target
    probabilities (B, N, V); in SAMPLED mode the current residual lives unnormalised in RES (B, V) with its total
    `z`, and every pass that writes RES ends with a barrier (later scalar reads come from other threads)."""
    b = tl.program_id(0).to(tl.int64)
    res = RES + b * V
    cur = tl.zeros([], tl.int64)
    depth = tl.zeros([], tl.int32)
    stop = tl.zeros([], tl.int32)
    while stop == 0:
        p_row = P + (b * N + cur) * V
        q_row = Q + (b * N + cur) * V
        coins = COINS + b * s_cb + depth * s_cd
        child = tl.load(FIRST_CHILD + b * s_fc + cur)
        nxt = tl.full([], -1, tl.int64)
        if SAMPLED:
            z = tl.zeros([], tl.float32)
            for start in range(0, V, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                row = tl.load(p_row + cols, cols < V, 0.0)
                tl.store(res + cols, row, cols < V)
                z += tl.sum(row, 0)
            tl.debug_barrier()
            k = tl.full([], 1, tl.int32)
            while (child >= 0) & (nxt < 0):
                x = tl.load(TOKENS + b * s_tok + child)
                px = tl.load(res + x) / z
                qx = tl.load(q_row + x).to(tl.float32)
                if tl.load(coins + k) * qx < px:
                    nxt = child
                else:  # p <- norm(max(p - q, 0)), kept unnormalised
                    tl.debug_barrier()  # every thread has read res[x] (px) before any overwrites it
                    z_new = tl.zeros([], tl.float32)
                    for start in range(0, V, BLOCK_V):
                        cols = start + tl.arange(0, BLOCK_V)
                        r = tl.load(res + cols, cols < V, 0.0) / z
                        r = tl.maximum(r - tl.load(q_row + cols, cols < V, 0.0).to(tl.float32), 0.0)
                        tl.store(res + cols, r, cols < V)
                        z_new += tl.sum(r, 0)
                    tl.debug_barrier()
                    z = z_new
                child = tl.load(NEXT_SIBLING + b * s_ns + child)
                k += 1
            y = _draw(res, z, tl.load(coins), V, BLOCK_V)
        else:
            y = _draw(p_row, _row_total(p_row, V, BLOCK_V), tl.load(coins), V, BLOCK_V)
            while (child >= 0) & (nxt < 0):
                if tl.load(TOKENS + b * s_tok + child) == y:
                    nxt = child
                child = tl.load(NEXT_SIBLING + b * s_ns + child)
        if nxt >= 0:
            depth += 1
            tl.store(ACCEPTED + b * s_acc + depth, nxt)
            cur = nxt
        else:
            tl.store(BONUS + b, y)
            tl.store(ACCEPT_LEN + b, depth.to(tl.int64))
            stop += 1


@on_first_device
def verify_sampled(
    tree_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    tree: Tree,
    coins: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of `eval.reference.verify_sampled`: the target distribution is processed in torch
    (`reference.target_probs`), the whole walk (acceptance tests, residuals, draws) is one program per request."""
    bsz, n = tree_tokens.shape
    tree = tree.batched(bsz)
    probs = reference.target_probs(target_logits, temperature, top_p).contiguous()  # (B, N, V) fp32
    vocab = probs.shape[-1]
    tokens, first_child, next_sibling = (x.contiguous() for x in (tree_tokens, tree.first_child, tree.next_sibling))
    coins = coins.float().contiguous()
    sampled = draft_probs is not None
    draft = draft_probs.contiguous() if sampled else probs
    residual = torch.empty(bsz, vocab, device=probs.device, dtype=torch.float32) if sampled else probs
    accept_len = torch.empty(bsz, dtype=torch.long, device=probs.device)
    accepted = torch.full((bsz, tree.max_depth + 1), -1, dtype=torch.long, device=probs.device)
    accepted[:, 0] = 0
    bonus = torch.empty_like(accept_len)
    _sampled_walk_kernel[(bsz,)](
        probs, draft, residual, tokens, first_child, next_sibling, coins, accept_len, accepted, bonus,
        n, vocab, tokens.stride(0), first_child.stride(0), next_sibling.stride(0), coins.stride(0), coins.stride(1),
        accepted.stride(0), SAMPLED=sampled, BLOCK_V=64 if INTERPRET else 2048, num_warps=1 if INTERPRET else 8,
    )  # fmt: skip
    return accept_len, accepted, bonus

"""Triton kernels for tree decoding, with the signatures and semantics of their twins in `eval.reference`.

Tested by `TRITON_INTERPRET=1 .venv/bin/pytest tests/test_kernels.py -q`; timed on a GPU by
`bash benchmarks/gpu_kernels.sh`.

    ops = get_ops("triton")            # or "reference": the same functions in plain PyTorch
    out = ops.tree_attention(q, k_prefix, v_prefix, k_tree, v_tree, mask_bits, scale)
    accept_len, accepted_nodes, bonus = ops.verify_greedy(tree_tokens, target_logits, tree)
    new_len = ops.kv_commit(k_cache, v_cache, prefix_len, accepted_nodes)

    name = register_tree_attention()   # HF models: model.set_attn_implementation(name)
    with tree_context(tree.mask_bits):
        logits = model(input_ids=tree_tokens, position_ids=tree.positions(prefix_len)[None], cache=cache).logits

What is fused: tree attention (prefix read once per query block, split-KV over the prefix, tree block under the
bitmask, log-sum-exp merge), greedy and typical verification (per-row argmax / log-sum-exp / entropy over the vocab,
then one program per request picks the longest accepted path from the ancestor bitmask), sampled verification (one
program per request walks first-child / next-sibling: acceptance tests, residual updates and inverse-CDF draws; only
the temperature / top-p processing of the target logits stays in torch) and the KV commit copy. Exact ties of
typical-acceptance path log-likelihoods (siblings with the same token) and float-rounding boundary cases (sums taken in
another order) may be resolved differently from the twins; everything else matches them exactly.

Without CUDA the kernels run only under the Triton interpreter, and only when TRITON_INTERPRET=1 is set before this
module is imported (the interpreter is chosen when the kernels are defined): `python -m eval` sets it when there is
no GPU, the test suite sets it itself; this module never does. The interpreter has no bf16 arithmetic, so inputs are
cast to fp32 after loading there.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from eval import reference
from eval.trees import Tree

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Whether the kernels below were defined for the Triton interpreter (TRITON_INTERPRET=1 at import)."""
LOG2E = 1.4426950408889634

__all__ = [
    "TREE_ATTENTION",
    "TreeOps",
    "get_ops",
    "kv_commit",
    "register_tree_attention",
    "tree_attention",
    "tree_context",
    "verify_greedy",
    "verify_sampled",
    "verify_typical",
]


# -------------------------------------------------------------------------------------------------- tree attention


@triton.jit
def _attend_block(q, k, v, visible, m_i, l_i, acc, qk_scale, CAST_F32: tl.constexpr):
    """One online-softmax step over a key block (scores in log2 units)."""
    if CAST_F32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(visible, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if CAST_F32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _tree_attention_kernel(
    Q, KP, VP, KT, VT, BITS, PLEN, OUT, O_PART, L_PART,
    sqb, sqh, sqn, skb, skh, skp, svb, svh, svp, stb, sth, stn, sub, suh, sun, sbb, sbn, sob, soh, son,
    H, N, P, D, R, split_len, qk_scale,
    HKV: tl.constexpr, GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, CAST_F32: tl.constexpr, RAGGED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (b * HKV + kv head, query block, prefix split). Rows are the GROUP query heads sharing the kv head
    times the N tree queries (row = g * N + n), so K/V are read once per kv head. Last dims are contiguous.
    RAGGED: row b sees only its first PLEN[b] prefix keys (splits past it attend to nothing there)."""
    pid_bh, pid_m, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b = (pid_bh // HKV).to(tl.int64)  # int64 offsets: caches can exceed 2^31 elements
    kvh = pid_bh % HKV
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * N
    n = rows % N
    h = kvh * GROUP + rows // N
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(Q + b * sqb + h[:, None] * sqh + n[:, None] * sqn + d[None, :], row_ok[:, None] & d_ok[None, :], 0.0)
    if CAST_F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # the prefix: every tree query sees all of it; this program reads split pid_s of it
    p_end = P
    if RAGGED:
        p_end = tl.minimum(tl.load(PLEN + b).to(tl.int32), P)  # as the twin: at most the whole prefix
    p_lo = pid_s * split_len
    p_hi = tl.minimum(p_lo + split_len, p_end)
    for start in range(p_lo, p_hi, BLOCK_P):
        cols = start + tl.arange(0, BLOCK_P)
        col_ok = cols < p_hi
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(KP + b * skb + kvh * skh + cols[:, None] * skp + d[None, :], kv_mask, 0.0)
        v = tl.load(VP + b * svb + kvh * svh + cols[:, None] * svp + d[None, :], kv_mask, 0.0)
        m_i, l_i, acc = _attend_block(q, k, v, col_ok[None, :], m_i, l_i, acc, qk_scale, CAST_F32)

    # the tree block under the ancestor bitmask, handled by the last split
    t_hi = tl.where(pid_s == NUM_SPLITS - 1, N, 0)
    for start in range(0, t_hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(KT + b * stb + kvh * sth + cols[:, None] * stn + d[None, :], kv_mask, 0.0)
        v = tl.load(VT + b * sub + kvh * suh + cols[:, None] * sun + d[None, :], kv_mask, 0.0)
        words = tl.load(BITS + b * sbb + n[:, None] * sbn + cols[None, :] // 32, row_ok[:, None] & col_ok[None, :], 0)
        visible = ((words >> (cols[None, :] % 32)) & 1) != 0
        m_i, l_i, acc = _attend_block(q, k, v, visible, m_i, l_i, acc, qk_scale, CAST_F32)

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # only padding rows see nothing: each node sees itself
    if NUM_SPLITS == 1:
        out = acc / l_safe[:, None]
        out_ptr = OUT + b * sob + h[:, None] * soh + n[:, None] * son + d[None, :]
        tl.store(out_ptr, out.to(OUT.dtype.element_ty), row_ok[:, None] & d_ok[None, :])
    else:
        r = (b * H + h) * N + n  # flat (b, h, n) row of the partial buffers
        part_ptr = O_PART + (pid_s * R + r)[:, None] * D + d[None, :]
        tl.store(part_ptr, acc / l_safe[:, None], row_ok[:, None] & d_ok[None, :])
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(L_PART + pid_s * R + r, lse, row_ok)


@triton.jit
def _merge_splits_kernel(
    O_PART, L_PART, OUT, R, H, N, D, sob, soh, son,
    NUM_SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Log-sum-exp merge of the per-split partial outputs (every row has mass in the last split)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    d = tl.arange(0, BLOCK_D)
    mask = r_ok[:, None] & (d < D)[None, :]
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(L_PART + s * R + r, r_ok, float("-inf")))
    m = tl.where(r_ok, m, 0.0)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    for s in range(NUM_SPLITS):
        w = tl.exp2(tl.load(L_PART + s * R + r, r_ok, float("-inf")) - m)
        acc += w[:, None] * tl.load(O_PART + (s * R + r)[:, None] * D + d[None, :], mask, 0.0)
        total += w
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    b, h, n = r // (H * N), (r // N) % H, r % N
    tl.store(
        OUT + b[:, None] * sob + h[:, None] * soh + n[:, None] * son + d[None, :], out.to(OUT.dtype.element_ty), mask
    )


def _on_device(t: torch.Tensor) -> AbstractContextManager:
    """Triton launches on the *current* CUDA device: make it the one holding `t` (layers of a `device_map` target
    live on several GPUs, and a launch with another GPU's pointers faults)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else nullcontext()


def _on_first_device(fn: Callable) -> Callable:
    """Run `fn` (whose first argument is a tensor) with that tensor's GPU current, see `_on_device`."""

    @functools.wraps(fn)
    def wrapper(first: torch.Tensor, *args, **kwargs):
        with _on_device(first):
            return fn(first, *args, **kwargs)

    return wrapper


def _pow2(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(x, 1))))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_splits(q: torch.Tensor, programs: int, p: int, block_p: int) -> int:
    """Split the prefix so that about two waves of programs fill the GPU (never on the interpreter)."""
    if INTERPRET or p == 0:
        return 1
    sms = _sm_count(q.device)
    return max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(p, 4 * block_p), 16))


@_on_first_device
def tree_attention(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    mask_bits: torch.Tensor,
    scale: float,
    prefix_lens: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton twin of `eval.reference.tree_attention`; `num_splits` overrides the split-KV heuristic (splits cover
    the whole prefix; with `prefix_lens` they end early for shorter rows)."""
    bsz, h, n, d = q.shape
    hkv, p = k_tree.shape[1], k_prefix.shape[2]
    group = h // hkv
    q, k_prefix, v_prefix, k_tree, v_tree = (
        x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_prefix, v_prefix, k_tree, v_tree)
    )
    mask_bits = mask_bits.expand(bsz, *mask_bits.shape[-2:]).to(torch.int32)
    if mask_bits.stride(-1) != 1:
        mask_bits = mask_bits.contiguous()
    cast_f32 = INTERPRET or q.dtype == torch.float32
    block_d = _pow2(d, 16, 256)
    block_m = _pow2(group * n, 16, 32 if INTERPRET else 64)
    block_p = 16 if INTERPRET else (32 if cast_f32 and block_d > 64 else 64)
    block_n = 16 if INTERPRET else 32
    m_blocks = triton.cdiv(group * n, block_m)
    splits = num_splits or _num_splits(q, bsz * hkv * m_blocks, p, block_p)
    split_len = triton.cdiv(triton.cdiv(p, splits), block_p) * block_p if p else 0
    splits = max(1, triton.cdiv(p, split_len)) if p else 1
    out = torch.empty_like(q)
    rows = bsz * h * n
    o_part = torch.empty((splits, rows, d), device=q.device, dtype=torch.float32) if splits > 1 else out
    l_part = torch.empty((splits, rows), device=q.device, dtype=torch.float32) if splits > 1 else out
    ragged = prefix_lens is not None
    plen = prefix_lens.to(q.device, torch.int32).expand(bsz).contiguous() if ragged else out  # no-op when int32
    _tree_attention_kernel[(bsz * hkv, m_blocks, splits)](
        q, k_prefix, v_prefix, k_tree, v_tree, mask_bits, plen, out, o_part, l_part,
        q.stride(0), q.stride(1), q.stride(2), k_prefix.stride(0), k_prefix.stride(1), k_prefix.stride(2),
        v_prefix.stride(0), v_prefix.stride(1), v_prefix.stride(2), k_tree.stride(0), k_tree.stride(1),
        k_tree.stride(2), v_tree.stride(0), v_tree.stride(1), v_tree.stride(2), mask_bits.stride(0),
        mask_bits.stride(1), out.stride(0), out.stride(1), out.stride(2),
        h, n, p, d, rows, split_len, scale * LOG2E,
        HKV=hkv, GROUP=group, NUM_SPLITS=splits, CAST_F32=cast_f32, RAGGED=ragged,
        BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_N=block_n, BLOCK_D=block_d,
    )  # fmt: skip
    if splits > 1:
        block_r = 16 if INTERPRET else 32
        _merge_splits_kernel[(triton.cdiv(rows, block_r),)](
            o_part, l_part, out, rows, h, n, d, out.stride(0), out.stride(1), out.stride(2),
            NUM_SPLITS=splits, BLOCK_R=block_r, BLOCK_D=block_d,
        )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------- verification


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
        z = tl.load(LOGITS + b.to(tl.int64) * s_lb + par * s_ln + tok, i_ok, 0.0).to(tl.float32) * inv_temp
        lp = z - tl.load(LSE + b * N + par, i_ok, 0.0)
        passed = lp > tl.load(LOG_THR + b * N + par, i_ok, 0.0)
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


@_on_first_device
def verify_greedy(
    tree_tokens: torch.Tensor, target_logits: torch.Tensor, tree: Tree
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of `eval.reference.verify_greedy` (row argmax kernel + longest-path kernel)."""
    return _verify_longest_path(tree_tokens, target_logits, tree, typical=False)


@_on_first_device
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
    """Inverse-CDF draw from an unnormalised row: the first index whose running sum exceeds u * total (the last
    index if rounding leaves none), as `eval.reference.sample_from`."""
    target = u * total
    carry = tl.zeros([], tl.float32)
    found = tl.full([], V, tl.int32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(ROW + cols, cols < V, 0.0)
        cdf = tl.cumsum(x, 0) + carry
        first = tl.min(tl.where((cdf > target) & (cols < V), cols, V), 0)
        found = tl.minimum(found, first)
        carry += tl.sum(x, 0)
    return tl.minimum(found, V - 1).to(tl.int64)


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


@_on_first_device
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


# ------------------------------------------------------------------------------------------------------- KV commit


@triton.jit
def _kv_commit_kernel(
    CACHE, NODES, PREFIX, START, s_b, s_h, s_s, s_nb, D,
    HKV: tl.constexpr, WIDTH: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (b * HKV + head, D tile), one warp. Steps run in order: step s reads row start + node[s] >= prefix + s
    (start >= prefix, node[s] >= s), which no earlier step wrote, and a row read at step s is overwritten only at a
    later step. Program order makes that safe within one warp (a D tile smaller than the warp replicates columns over
    lanes of that warp only)."""
    pid = tl.program_id(0)
    b = pid // HKV
    base = CACHE + b.to(tl.int64) * s_b + (pid % HKV).to(tl.int64) * s_h
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    prefix = tl.load(PREFIX + b)
    start = tl.load(START + b)
    for s in range(WIDTH):
        node = tl.load(NODES + b * s_nb + s)
        ok = d_ok & ((d * 0 + node) >= 0)  # a vector mask: the interpreter rejects scalar & vector masks
        row = tl.load(base + (start + node) * s_s + d, ok)
        tl.store(base + (prefix + s) * s_s + d, row, ok)


def kv_commit(
    k_cache: torch.Tensor | list[torch.Tensor],
    v_cache: torch.Tensor | list[torch.Tensor],
    prefix_len: int | torch.Tensor,
    accepted_nodes: torch.Tensor,
    tree_start: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of `eval.reference.kv_commit` (one launch per cache tensor). `tree_start >= prefix_len` is the
    caller's to keep (the twin checks it; checking here would wait for the GPU)."""
    bsz, width = accepted_nodes.shape
    nodes = accepted_nodes.contiguous()
    prefix = torch.as_tensor(prefix_len, device=nodes.device, dtype=torch.long).expand(bsz).contiguous()
    start = prefix if tree_start is None else torch.as_tensor(tree_start, device=nodes.device, dtype=torch.long)
    start = start.expand(bsz).contiguous()
    caches = [k_cache] if isinstance(k_cache, torch.Tensor) else list(k_cache)
    caches += [v_cache] if isinstance(v_cache, torch.Tensor) else list(v_cache)
    on = {nodes.device: (nodes, prefix, start)}  # the indices on each cache's device (device_map: several GPUs)
    for cache in caches:
        _, hkv, _, d = cache.shape
        if cache.stride(-1) != 1:
            raise ValueError("kv_commit needs caches with a contiguous last dimension")
        if cache.device not in on:
            on[cache.device] = tuple(x.to(cache.device) for x in (nodes, prefix, start))
        cache_nodes, cache_prefix, cache_start = on[cache.device]
        block_d = _pow2(d, 16, 128)
        with _on_device(cache):
            _kv_commit_kernel[(bsz * hkv, triton.cdiv(d, block_d))](
                cache, cache_nodes, cache_prefix, cache_start, cache.stride(0), cache.stride(1), cache.stride(2),
                cache_nodes.stride(0), d, HKV=hkv, WIDTH=width, BLOCK_D=block_d, num_warps=1,
            )  # fmt: skip
    return prefix + (nodes >= 0).sum(-1)


# ------------------------------------------------------------------------------------------------------ op sets


@dataclass(frozen=True)
class TreeOps:
    """The tree-decoding ops of one backend; every field has the signature of its `eval.reference` twin."""

    tree_attention: Callable[..., torch.Tensor]
    verify_greedy: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    verify_typical: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    verify_sampled: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    kv_commit: Callable[..., torch.Tensor]
    draw_coins: Callable[..., torch.Tensor]


_OPS = {
    "triton": TreeOps(tree_attention, verify_greedy, verify_typical, verify_sampled, kv_commit, reference.draw_coins),
    "reference": TreeOps(
        reference.tree_attention,
        reference.verify_greedy,
        reference.verify_typical,
        reference.verify_sampled,
        reference.kv_commit,
        reference.draw_coins,
    ),
}


def get_ops(kind: str = "triton") -> TreeOps:
    """`"triton"` (fused kernels: on the GPU, or under the Triton interpreter) or `"reference"` (plain PyTorch)."""
    if kind not in _OPS:
        raise ValueError(f"unknown ops kind {kind!r}; expected one of {sorted(_OPS)}")
    if kind == "triton" and not INTERPRET and not torch.cuda.is_available():
        raise RuntimeError(
            "the Triton kernels need a GPU, or the Triton interpreter: set TRITON_INTERPRET=1 before eval.kernels is "
            "imported (`python -m eval` does when there is no GPU), or use the reference kernels"
        )
    return _OPS[kind]


# ---------------------------------------------------------------------------------- transformers AttentionInterface

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

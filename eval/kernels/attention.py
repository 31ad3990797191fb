"""Triton tree attention: the N tree queries of each request attend to a cached prefix (all of it, or its first
`prefix_lens[b]` keys) and, under the ancestor bitmask, to the N tree keys; twin of `eval.reference.tree_attention`.

    out = tree_attention(q, k_prefix, v_prefix, k_tree, v_tree, mask_bits, scale)     # (B, H, N, D)
    out = tree_attention(..., prefix_lens=lens, num_splits=4)                          # ragged rows, forced splits

One program per (request, kv head, query block, prefix split): the query heads sharing a kv head are rows of one
block, so the prefix is read once per query block; split-KV over the prefix fills the GPU at small batch, and
`_merge_splits_kernel` merges the splits by log-sum-exp. The tree block is attended by the last split.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from eval.kernels.launch import INTERPRET, on_first_device, pow2

LOG2E = 1.4426950408889634  # the kernels keep scores in log2 units (exp2, log2); qk_scale folds this in


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


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_splits(q: torch.Tensor, programs: int, p: int, block_p: int) -> int:
    """Split the prefix so that about two waves of programs fill the GPU (never on the interpreter)."""
    if INTERPRET or p == 0:
        return 1
    sms = _sm_count(q.device)
    return max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(p, 4 * block_p), 16))


MAX_HEAD_DIM = 256
"""The widest head the kernel holds in one tile (BLOCK_D)."""


@on_first_device
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
    if d > MAX_HEAD_DIM or {x.shape[-1] for x in (k_prefix, v_prefix, k_tree, v_tree)} != {d}:
        raise ValueError(
            f"tree_attention kernel: head dims q {d}, k {k_tree.shape[-1]}, v {v_tree.shape[-1]}: it takes one head "
            f"dim up to {MAX_HEAD_DIM} for queries, keys and values (use eval.kernels: reference)"
        )
    q, k_prefix, v_prefix, k_tree, v_tree = (
        x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_prefix, v_prefix, k_tree, v_tree)
    )
    mask_bits = mask_bits.expand(bsz, *mask_bits.shape[-2:]).to(torch.int32)
    if mask_bits.stride(-1) != 1:
        mask_bits = mask_bits.contiguous()
    # tl.dot takes two operands of one 16-bit type, else everything is computed in fp32
    cast_f32 = (
        INTERPRET or q.dtype == torch.float32 or len({x.dtype for x in (q, k_prefix, v_prefix, k_tree, v_tree)}) > 1
    )
    block_d = pow2(d, 16, MAX_HEAD_DIM)
    block_m = pow2(group * n, 16, 32 if INTERPRET else 64)
    # shared memory (sm_90: 227 KB a block): head dim 256 in 16 bits with 64-key blocks needs 224 KB under Triton 3.9
    block_p = 16 if INTERPRET else (32 if block_d > 128 or (cast_f32 and block_d > 64) else 64)
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

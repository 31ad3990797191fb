"""Fused stage 1 of the two-stage LM head (`eval.heads.TwoStageHead`): low-rank scores of the whole vocabulary
with a local top-k per vocabulary tile, so the (N, V) score matrix is never written to memory; Triton kernel and its
PyTorch twin.

    perm = torch.randperm(V)                             # shuffled row -> token id
    a_shuffled = a[perm]                                 # the factor A (V, r), rows shuffled once
    u = h @ b.T                                          # (N, r): the cheap part, in torch
    scores, ids = lowrank_topk(u, a_shuffled, perm, block_v=256, k_local=16, candidates=256)  # (N, C) each
    scores, ids = lowrank_topk(..., kernels="reference")  # the twin, `lowrank_topk_reference`

Semantics (kernel and twin alike): the shuffled vocabulary is cut into tiles of `block_v` rows (the last one may be
shorter); each tile keeps its `k_local` best scores u·A_vᵀ, and the candidates are the best `candidates` of those
survivors, sorted by score descending. This is *not* exactly the global top-C of all V scores: a tile holding more than
`k_local` of the global top-C loses the rest. It is when `k_local >= block_v` (every row survives), and the global
top-1 always survives (it is its tile's maximum). Ties are broken towards the lower shuffled index, within a tile and
across tiles. The rows are shuffled before tiling because frequent tokens cluster in the original token order (low
ids in a BPE vocabulary), so unshuffled tiles would hold several of a row's top tokens at once.

The kernel: one program per (row block of N, vocabulary tile); the scores of the tile come from tl.dot over chunks of
r (fp32 accumulation; fp32 inputs, and all inputs under the interpreter, use `input_precision="ieee"`), then
`k_local` rounds of max-and-mask (first maximum, i.e. lowest shuffled index) write (N, n_tiles, k_local) scores and
token ids. A tile with fewer than `k_local` rows pads with score -inf and token id -1, which the final selection never
picks (`candidates` may not exceed the number of real survivors). The selection over the n_tiles·k_local survivors
is shared torch code (a stable sort, so equal scores keep the lower shuffled index first).

Scores match the twin to fp32 rounding (the sums are taken in another order), and so ids match exactly except where
two scores are within that rounding of each other. The row block shrinks as `block_v` grows (BLOCK_N·block_v <=
16,384 scores in registers, BLOCK_N >= 16 for tl.dot); compiled for sm_90, tiles of up to 512 rows run without
register spills, 1,024 rows spill (slower, still correct). One pipeline stage: with the default three, 1,024-row tiles
overflow the 227 KB of shared memory a block may use.
Tested by `TRITON_INTERPRET=1 .venv/bin/pytest tests/test_lowrank_kernel.py -q`; `benchmarks/lowrank_topk.py` measures
the recall of the tile-local screen (the GPU timing of the kernel is left for a device run).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eval.kernels.launch import INTERPRET, on_first_device, pow2

KERNELS = ("triton", "reference")
TILE_SCORES = 16_384  # at most BLOCK_N * block_v scores per program
MAX_FP32_BLOCK_V = 512  # sm_90, float32 inputs: 512-row tiles take 136 KB of shared memory, 1024-row ones 260 KB


@triton.jit
def _lowrank_tile_topk_kernel(
    U, A, PERM, S_OUT, I_OUT, N, V, R, n_tiles, s_un, s_av, s_on,
    CAST_F32: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Program (row block, vocabulary tile): scores = u[rows] @ A[tile]ᵀ (BLOCK_N, BLOCK_V), then K rounds of
    max-and-mask; round j writes each row's j-th best score and its token id PERM[shuffled index] to
    S_OUT / I_OUT[row, tile, j] (-inf and -1 once the tile's real rows are used up). Last dims are contiguous."""
    pid_n, pid_v = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # shuffled indices
    col_ok = cols < V
    rr = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r_ok = (r0 + rr) < R
        u = tl.load(U + rows[:, None].to(tl.int64) * s_un + r0 + rr[None, :], row_ok[:, None] & r_ok[None, :], 0.0)
        a = tl.load(A + cols[:, None].to(tl.int64) * s_av + r0 + rr[None, :], col_ok[:, None] & r_ok[None, :], 0.0)
        if CAST_F32:
            acc += tl.dot(u.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(u, tl.trans(a))
    s = tl.where(col_ok[None, :], acc, float("-inf"))
    local = tl.arange(0, BLOCK_V)
    out = rows.to(tl.int64) * s_on + pid_v * K
    for j in tl.static_range(K):
        best, where = tl.max(s, 1, return_indices=True, return_indices_tie_break_left=True)  # (BLOCK_N,) each
        real = best > float("-inf")
        token = tl.load(PERM + pid_v * BLOCK_V + where, row_ok & real, -1)
        tl.store(S_OUT + out + j, best, row_ok)
        tl.store(I_OUT + out + j, tl.where(real, token, -1).to(tl.int64), row_ok)
        s = tl.where(local[None, :] == where[:, None], float("-inf"), s)


def _check(
    u: torch.Tensor, a_shuffled: torch.Tensor, perm: torch.Tensor, block_v: int, k_local: int, candidates: int
) -> None:
    """Validate the arguments; a bad one is named in the message."""
    if u.dim() != 2 or a_shuffled.dim() != 2 or u.shape[1] != a_shuffled.shape[1]:
        raise ValueError(f"u (N, r) and a_shuffled (V, r): got {tuple(u.shape)} and {tuple(a_shuffled.shape)}")
    vocab = a_shuffled.shape[0]
    if perm.shape != (vocab,):
        raise ValueError(f"perm: want shape ({vocab},), got {tuple(perm.shape)}")
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v={block_v}: want a power of two >= 16 (a tl.arange / tl.dot tile)")
    if k_local < 1:
        raise ValueError(f"k_local={k_local}: want k_local >= 1")
    survivors = tile_survivors(vocab, block_v, k_local)
    if not 1 <= candidates <= survivors:
        raise ValueError(
            f"candidates={candidates}: want 1 <= candidates <= the {survivors} tile survivors "
            f"(V={vocab}, block_v={block_v}, k_local={k_local})"
        )


def tile_survivors(vocab: int, block_v: int, k_local: int) -> int:
    """How many real rows survive the tiles' local top-k: the most `candidates` can be."""
    k = min(k_local, block_v)
    return (vocab // block_v) * k + min(k, vocab % block_v)


def tile_topk_reference(
    u: torch.Tensor, a_shuffled: torch.Tensor, perm: torch.Tensor, block_v: int, k_local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of the kernel: per-tile survivors (scores (N, n_tiles, k) float32, token ids (N, n_tiles, k) int64),
    k = min(k_local, block_v), each tile's best first (ties: lower shuffled index first); padding -inf / -1."""
    n, vocab = u.shape[0], a_shuffled.shape[0]
    n_tiles, k = triton.cdiv(vocab, block_v), min(k_local, block_v)
    scores = u.to(torch.float32) @ a_shuffled.to(torch.float32).T  # (N, V): the twin may write them
    pad = n_tiles * block_v - vocab
    scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf")).view(n, n_tiles, block_v)
    best, where = scores.sort(dim=-1, descending=True, stable=True)  # stable: lower index first among ties
    best, where = best[..., :k], where[..., :k]  # (N, n_tiles, k)
    shuffled = where + torch.arange(n_tiles, device=u.device)[:, None] * block_v
    tokens = perm.to(torch.int64)[shuffled.clamp(max=vocab - 1)]
    return best, torch.where(best > float("-inf"), tokens, -1)


@on_first_device
def tile_topk(
    u: torch.Tensor, a_shuffled: torch.Tensor, perm: torch.Tensor, block_v: int, k_local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton kernel: per-tile survivors, as `tile_topk_reference` (the full scores are never written)."""
    if not INTERPRET and not u.is_cuda:
        raise RuntimeError(
            "the Triton kernels need a GPU, or the Triton interpreter: set TRITON_INTERPRET=1 before eval.kernels is "
            "imported, or use kernels='reference'"
        )
    n, r = u.shape
    vocab = a_shuffled.shape[0]
    if not INTERPRET and u.dtype == torch.float32 and block_v > MAX_FP32_BLOCK_V:
        raise ValueError(
            f"lowrank_topk: block_v={block_v} with float32 factors needs more shared memory than a GPU block has; use "
            f"block_v <= {MAX_FP32_BLOCK_V}, or 16-bit factors"
        )
    n_tiles, k = triton.cdiv(vocab, block_v), min(k_local, block_v)
    u = u if u.stride(-1) == 1 else u.contiguous()
    a_shuffled = a_shuffled if a_shuffled.stride(-1) == 1 else a_shuffled.contiguous()
    if a_shuffled.dtype != u.dtype:
        a_shuffled = a_shuffled.to(u.dtype)
    perm = perm.to(u.device, torch.int64).contiguous()
    scores = torch.empty((n, n_tiles, k), device=u.device, dtype=torch.float32)
    tokens = torch.empty((n, n_tiles, k), device=u.device, dtype=torch.int64)
    block_n = max(16, min(pow2(n, 16, 64), TILE_SCORES // block_v))
    block_r = pow2(r, 16, 64)
    cast_f32 = INTERPRET or u.dtype == torch.float32
    _lowrank_tile_topk_kernel[(triton.cdiv(n, block_n), n_tiles)](
        u, a_shuffled, perm, scores, tokens, n, vocab, r, n_tiles, u.stride(0), a_shuffled.stride(0), n_tiles * k,
        CAST_F32=cast_f32, K=k, BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_R=block_r,
        num_stages=1,  # the r loop is short (one chunk up to r = 64); 3 stages of 1024-row tiles overflow shared memory
    )  # fmt: skip
    return scores, tokens


def select_candidates(scores: torch.Tensor, tokens: torch.Tensor, candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best `candidates` of the per-tile survivors (N, n_tiles, k): (scores (N, C), token ids (N, C)), score
    descending. Survivors are laid out by tile, then by rank within the tile, so equal scores appear in shuffled
    index order and a stable sort keeps the lower shuffled index first."""
    flat_s, flat_t = scores.flatten(1), tokens.flatten(1)
    best, where = flat_s.sort(dim=-1, descending=True, stable=True)
    where = where[:, :candidates]
    return best[:, :candidates], flat_t.gather(1, where)


def lowrank_topk_reference(
    u: torch.Tensor, a_shuffled: torch.Tensor, perm: torch.Tensor, block_v: int, k_local: int, candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch twin of `lowrank_topk(..., kernels="triton")`: the same tile-local semantics and tie-breaking."""
    _check(u, a_shuffled, perm, block_v, k_local, candidates)
    return select_candidates(*tile_topk_reference(u, a_shuffled, perm, block_v, k_local), candidates)


def lowrank_topk(
    u: torch.Tensor,
    a_shuffled: torch.Tensor,
    perm: torch.Tensor,
    block_v: int,
    k_local: int,
    candidates: int,
    kernels: str = "triton",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage-1 candidates from u = h·Bᵀ (N, r) and the shuffled factor A[perm] (V, r): (scores (N, C) float32,
    token ids (N, C) int64), sorted by score descending; the union of each tile's top `k_local`, then the global top
    `candidates` of those (see the module docstring). `kernels`: "triton" (the fused kernel; on a GPU or under the
    Triton interpreter) or "reference" (`lowrank_topk_reference`)."""
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels {kernels!r}; expected one of {list(KERNELS)}")
    if kernels == "reference":
        return lowrank_topk_reference(u, a_shuffled, perm, block_v, k_local, candidates)
    _check(u, a_shuffled, perm, block_v, k_local, candidates)
    return select_candidates(*tile_topk(u, a_shuffled, perm, block_v, k_local), candidates)

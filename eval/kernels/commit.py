"""Triton KV commit: after verification, copy the KV rows of the accepted tree nodes right after the prefix, in
path order; twin of `eval.reference.kv_commit`.

    new_len = kv_commit(k_caches, v_caches, prefix_len, accepted_nodes)                 # tree rows at prefix_len
    new_len = kv_commit(k_caches, v_caches, prefix_len, accepted_nodes, tree_start=s)   # tree rows at s >= prefix_len

Caches are (B, Hkv, S, D) tensors (or lists of them, one per layer, on any GPUs); one launch per cache tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eval.kernels.launch import on_device, pow2


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
        block_d = pow2(d, 16, 128)
        with on_device(cache):
            _kv_commit_kernel[(bsz * hkv, triton.cdiv(d, block_d))](
                cache, cache_nodes, cache_prefix, cache_start, cache.stride(0), cache.stride(1), cache.stride(2),
                cache_nodes.stride(0), d, HKV=hkv, WIDTH=width, BLOCK_D=block_d, num_warps=1,
            )  # fmt: skip
    return prefix + (nodes >= 0).sum(-1)

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

Files, one job each: `attention.py` (tree attention), `verify.py` (greedy, typical and sampled verification),
`commit.py` (KV commit), `hf.py` (tree attention registered with transformers), `ops.py` (`get_ops`: Triton or the
twins), `launch.py` (what the launch wrappers share: the interpreter flag, the launch device, block sizes).

What is fused: tree attention (prefix read once per query block, split-KV over the prefix, tree block under the
bitmask, log-sum-exp merge), greedy and typical verification (per-row argmax / log-sum-exp / entropy over the vocab,
then one program per request picks the longest accepted path from the ancestor bitmask), sampled verification (one
program per request walks first-child / next-sibling: acceptance tests, residual updates and inverse-CDF draws; only
the temperature / top-p processing of the target logits stays in torch) and the KV commit copy. Exact ties of
typical-acceptance path log-likelihoods (siblings with the same token) and float-rounding boundary cases (sums taken in
another order) may be resolved differently from the twins; everything else matches them exactly.

Without CUDA the kernels run only under the Triton interpreter, and only when TRITON_INTERPRET=1 is set before this
package is imported (the interpreter is chosen when the kernels are defined): `python -m eval` sets it when there is
no GPU, the test suite sets it itself; this package never does. The interpreter has no bf16 arithmetic, so inputs are
cast to fp32 after loading there.
"""

from eval.kernels.attention import tree_attention
from eval.kernels.commit import kv_commit
from eval.kernels.hf import TREE_ATTENTION, register_tree_attention, tree_context
from eval.kernels.launch import INTERPRET
from eval.kernels.ops import TreeOps, get_ops
from eval.kernels.verify import verify_greedy, verify_sampled, verify_typical

__all__ = [
    "INTERPRET",
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

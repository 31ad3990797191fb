"""Check the tree kernels against their PyTorch twins on a GPU and time tree attention against masked SDPA.

    bash benchmarks/gpu_kernels.sh            # lent NVIDIA GPU, under 8 minutes, installs nothing
    bash benchmarks/gpu_kernels.sh --smoke    # CPU, Triton interpreter, tiny shapes

Prints `check …: ok|FAIL` lines, then `tree_attention/sdpa …: X (goal <= 1.0)` time ratios for N = 64 tree tokens
(Medusa's published mc_sim_7b_63 tree) over a 4k-token prefix, 32 heads x 128 head dim, GQA with 8 kv heads,
B = 1 and 8. SDPA gets a dense float mask over prefix + tree and K/V already repeated to 32 heads (repeat
outside the timed region).
Also decodes with a tiny target spread over two devices the way `target.device_map` spreads one (two GPUs, or one
GPU and the CPU), greedy speculative output against plain greedy, and decodes a batch of prompts of different
lengths over a ragged KV cache, each row against plain greedy. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from eval import kernels, reference  # noqa: E402
from eval.trees import MC_SIM_7B_63, Tree, medusa_tree, stack_trees  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
FAILURES: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"check {name}: {'ok' if ok else 'FAIL'} {detail}".rstrip(), flush=True)
    if not ok:
        FAILURES.append(name)


def random_tree(n: int, gen: torch.Generator) -> Tree:
    return Tree.from_parents([-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)])


def attention_inputs(b, h, hkv, p, n, d, dtype, device, gen):
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
    return rnd(b, h, n, d), rnd(b, hkv, p, d), rnd(b, hkv, p, d), rnd(b, hkv, n, d), rnd(b, hkv, n, d)


def check_attention(dtypes, shapes, device, gen) -> None:
    for dtype in dtypes:
        for b, h, hkv, p, n, d in shapes:
            trees = stack_trees([random_tree(n, gen) for _ in range(b)]).to(device)
            q, kp, vp, kt, vt = attention_inputs(b, h, hkv, p, n, d, dtype, device, gen)
            want = reference.tree_attention(q, kp, vp, kt, vt, trees.mask_bits, d**-0.5).float()
            for splits in (None, 1, 3):
                got = kernels.tree_attention(q, kp, vp, kt, vt, trees.mask_bits, d**-0.5, num_splits=splits).float()
                err = (got - want).abs().max().item()
                name = f"tree_attention {str(dtype)[6:]} B={b} H={h}/{hkv} P={p} N={n} D={d} splits={splits}"
                check(name, err <= TOLERANCE[dtype], f"max abs err {err:.2e}")
            lens = torch.randint(0, p + 1, (b,), generator=gen).to(device)  # a ragged batch: per-row prefix ends
            want = reference.tree_attention(q, kp, vp, kt, vt, trees.mask_bits, d**-0.5, prefix_lens=lens).float()
            for splits in (None, 3):
                got = kernels.tree_attention(
                    q, kp, vp, kt, vt, trees.mask_bits, d**-0.5, prefix_lens=lens, num_splits=splits
                ).float()
                err = (got - want).abs().max().item()
                name = f"tree_attention ragged {str(dtype)[6:]} B={b} H={h}/{hkv} P={p} N={n} D={d} splits={splits}"
                check(name, err <= TOLERANCE[dtype], f"prefix lens {lens.tolist()}, max abs err {err:.2e}")


def check_verify(b: int, n: int, vocab: int, device, gen) -> None:
    tree = stack_trees([random_tree(n, gen) for _ in range(b)]).to(device)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (3 * torch.randn(b, n, vocab, generator=gen)).to(device=device, dtype=dtype)
        argmax = logits.argmax(-1)
        parents = tree.parents.clamp(min=0)
        earlier = (tree.parents[:, None, :] == tree.parents[:, :, None]) & torch.ones(
            n, n, dtype=torch.bool, device=device
        ).tril(-1)
        shift = torch.where(torch.rand(b, n, generator=gen) < 0.7, 0, torch.randint(1, vocab, (b, n), generator=gen))
        tokens = (argmax.gather(1, parents) + earlier.sum(-1) + shift.to(device).gather(1, parents)) % vocab
        ref, tri = kernels.get_ops("reference"), kernels.get_ops("triton")
        cases = {
            "verify_greedy": (ref.verify_greedy(tokens, logits, tree), tri.verify_greedy(tokens, logits, tree)),
            "verify_greedy(argmax)": (ref.verify_greedy(tokens, argmax, tree), tri.verify_greedy(tokens, argmax, tree)),
            "verify_typical": (
                ref.verify_typical(tokens, logits, tree, temperature=0.7),
                tri.verify_typical(tokens, logits, tree, temperature=0.7),
            ),
        }
        q = torch.softmax(logits.float() + torch.randn(b, n, vocab, generator=gen).to(device), -1)
        sampled = torch.multinomial(q.view(-1, vocab), 1, generator=None).view(b, n)
        coins = reference.draw_coins(tree, b).to(device)
        for draft, children in ((q, sampled), (None, tokens)):
            mode = "sampled" if draft is not None else "top-k"
            cases[f"verify_sampled({mode})"] = (
                ref.verify_sampled(children, logits, tree, coins, draft, temperature=0.8, top_p=0.95),
                tri.verify_sampled(children, logits, tree, coins, draft, temperature=0.8, top_p=0.95),
            )
        for name, (want, got) in cases.items():
            same = all(torch.equal(w, g) for w, g in zip(want, got))
            rows = sum(not all(torch.equal(w[i], g[i]) for w, g in zip(want, got)) for i in range(b))
            detail = f"mean accept {want[0].float().mean():.2f}" + ("" if same else f", {rows}/{b} rows differ")
            check(f"{name} {str(dtype)[6:]} B={b} N={n} V={vocab}", same, detail)


def check_lowrank(n: int, vocab: int, rank: int, device, gen, cases) -> None:
    """The two-stage head's fused screen against its twin: per-tile scores within rounding, and the kernel's ids
    are tokens with those scores (ids may differ from the twin's only between scores within rounding)."""
    from eval.kernels.lowrank import tile_topk, tile_topk_reference

    for dtype, block_v in cases:
        u = torch.randn(n, rank, generator=gen).to(device, dtype)
        a = torch.randn(vocab, rank, generator=gen).to(device, dtype)
        perm = torch.randperm(vocab, generator=gen).to(device)
        got_s, got_i = tile_topk(u, a[perm], perm, block_v, 16)
        want_s, _ = tile_topk_reference(u, a[perm], perm, block_v, 16)
        full = u.float() @ a.float().T  # (N, V) by token id
        at_ids = full.gather(1, got_i.clamp(min=0).flatten(1)).view_as(got_s)
        real = got_i >= 0
        err = max((got_s - want_s).abs()[real].max().item(), (at_ids - got_s).abs()[real].max().item())
        tol = 1e-3 * full.abs().max().item()
        name = f"lowrank_topk {str(dtype)[6:]} N={n} V={vocab} r={rank} block_v={block_v}"
        check(name, err <= tol and torch.equal(real, want_s > float("-inf")), f"max abs err {err:.2e} (tol {tol:.1e})")


def check_loader_decode(device, gen) -> None:
    """Encoded feature stores (fp8, pca) decode on the training device as on the CPU (`data.loader.BatchLoader`)."""
    import tempfile

    from data.codecs import PcaCodec
    from data.loader import BatchLoader
    from data.shards import FeatureDataset, FeatureShardWriter

    layers, d = [0, -1], 32
    lengths = [int(torch.randint(5, 30, (), generator=gen)) for _ in range(8)]
    hidden = [torch.randn(n, len(layers), d, generator=gen) for n in lengths]
    for dtype in ("fp8_e4m3", "pca"):
        with tempfile.TemporaryDirectory() as tmp:
            header = {"target": {"name": "t"}, "layers": layers, "hidden_size": d, "dtype": dtype, "template": "x"}
            codec = PcaCodec.fit(torch.cat(hidden), [4.0, 4.0]) if dtype == "pca" else None
            writer = FeatureShardWriter(tmp, header, shard_tokens=60, codec=codec)
            for i, h in enumerate(hidden):
                ids = torch.randint(3, 100, (len(h),), generator=gen)
                writer.add(i, ids, torch.ones(len(h)), h)
            writer.close()
            ds = FeatureDataset(tmp)
            first = lambda dev, ds=ds: next(BatchLoader(ds, batch_size=4, shuffle=False, device=dev).batches())
            cpu, here = first("cpu"), first(device)
            err = (here["hidden"].cpu() - cpu["hidden"]).abs().max().item()
            placed = here["hidden"].device.type == device.type
            check(f"loader decode {dtype} on {device.type}", placed and err < 1e-4, f"max abs err {err:.2e}")


def check_kv_commit(device, gen) -> None:
    caches = [torch.randn(4, 8, 300, 128, generator=gen).to(device, torch.bfloat16) for _ in range(4)]
    twins = [c.clone() for c in caches]
    prefix = torch.tensor([3, 90, 200, 17], device=device)
    accepted = torch.tensor([[0, 4, 6, 11, -1], [0, 1, 2, 3, 4], [0, -1, -1, -1, -1], [0, 2, 5, 7, 30]], device=device)
    want = reference.kv_commit(twins[:2], twins[2:], prefix, accepted)
    got = kernels.kv_commit(caches[:2], caches[2:], prefix, accepted)
    check("kv_commit bf16", torch.equal(want, got) and all(torch.equal(a, b) for a, b in zip(caches, twins)))
    start = 240  # a ragged batch: every row's tree block after the longest prefix
    want = reference.kv_commit(twins[:2], twins[2:], prefix, accepted, tree_start=start)
    got = kernels.kv_commit(caches[:2], caches[2:], prefix, accepted, tree_start=start)
    same = torch.equal(want, got) and all(torch.equal(a, b) for a, b in zip(caches, twins))
    check("kv_commit ragged bf16", same)


def check_batch_decode(device, kernels_list: tuple[str, ...]) -> None:
    """A tiny Llama target decodes three prompts of different lengths as one batch whose rows accept never / always /
    sometimes (a ragged KV cache): each row equals plain greedy decoding of its prompt alone."""
    from eval.baselines import plain_generate
    from eval.checks import PerRow, ScriptedProposer
    from eval.decode import DecodeSettings, speculative_generate_batch
    from models.target import load_target

    config = {
        "model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "initializer_range": 0.2, "tie_word_embeddings": False,
    }  # fmt: skip
    model = load_target(random_init=config, dtype="float32", seed=0).model.to(device)
    prompts = [torch.tensor(p, device=device) for p in ([5, 17, 3, 42, 8, 77, 23], [9, 4, 61], [30, 2, 2, 71] * 3)]
    settings = DecodeSettings(max_new_tokens=24)
    plains = [plain_generate(model, p[None], settings).tokens for p in prompts]
    for kernels_kind in kernels_list:
        stubs = PerRow(
            [
                ScriptedProposer(t, len(p), [-1, 0, 0, 0, 1, 1, 2, 4, 4, 7], mode, 96, 3)
                for t, p, mode in zip(plains, prompts, ("never", "always", "sometimes"))
            ]
        )
        out = speculative_generate_batch(model, stubs, prompts, settings, kernels_kind)
        rounds = [len(r.accepted) for r in out]
        check(f"batch of 3 ragged rows {kernels_kind}", [r.tokens for r in out] == plains, f"rounds per row {rounds}")


def check_spread_target(devices: list[str], kernels_list: tuple[str, ...]) -> None:
    """A tiny Llama target spread over `devices` like a `device_map` target (KV caches on several devices, the
    lm_head on the last one): greedy speculative decoding equals plain greedy on each kernel path, with a scripted
    stub drafter and with (untrained) drafters that borrow the target's lm_head: EAGLE over a draft vocabulary,
    Medusa heads sharing the lm_head."""
    from eval.baselines import plain_generate, plain_generate_batch
    from eval.checks import ScriptedProposer, spread_layers
    from eval.decode import DecodeSettings, speculative_generate, speculative_generate_batch
    from eval.eagle_proposer import EagleProposer
    from eval.static_proposers import MedusaProposer
    from eval.trees import chain
    from methods.eagle2.model import EagleConfig, EagleDrafter
    from methods.medusa1.model import MedusaConfig, MedusaHeads
    from models.target import load_target

    config = {
        "model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "initializer_range": 0.2, "tie_word_embeddings": False,
    }  # fmt: skip
    target = load_target(random_init=config, dtype="float32", seed=0)
    prompt = torch.tensor([[5, 17, 3, 42, 8, 77, 23]], device=devices[0])
    settings = DecodeSettings(max_new_tokens=24)
    target.model.to(devices[0])
    plain = plain_generate(target.model, prompt, settings)
    placement = spread_layers(target.model, devices)
    caches_on = sorted({str(d) for d in placement.values()})
    parts = target.parts([-1])
    torch.manual_seed(0)
    eagle = EagleDrafter(EagleConfig(), parts).to(devices[0]).eval()
    medusa = MedusaHeads(MedusaConfig(num_heads=2, share_lm_head=True), parts).to(devices[0]).eval()
    vocab = torch.arange(0, 96, 2, device=devices[0])
    for kernels_kind in kernels_list:
        stub = ScriptedProposer(plain.tokens, prompt.shape[1], [-1, 0, 0, 0, 1, 1, 2, 4, 4, 7], "sometimes", 96, 3)
        out = speculative_generate(target.model, stub, prompt, settings, kernels_kind)
        check(
            f"spread target over {'+'.join(caches_on)} {kernels_kind} stub",
            out.tokens == plain.tokens and sum(out.accepted) > 0,
            f"accepted {sum(out.accepted)} drafts in {len(out.accepted)} rounds",
        )
        for name, proposer in (
            ("eagle draft-vocab", EagleProposer(eagle, depth=3, top_k=2, total_tokens=6, draft_vocab=vocab)),
            ("medusa shared-lm_head", MedusaProposer(medusa, chain(2))),
        ):
            out = speculative_generate(target.model, proposer, prompt, settings, kernels_kind)
            check(f"spread target over {'+'.join(caches_on)} {kernels_kind} {name}", out.tokens == plain.tokens)
        # a batch of prompts of different lengths (padded prefill, ragged caches on every device)
        prompts = [prompt[0], prompt[0, :3], torch.cat([prompt[0], prompt[0, 1:]])]
        plains = [plain_generate(target.model, p[None], settings).tokens for p in prompts]
        batched_plain = [r.tokens for r in plain_generate_batch(target.model, prompts, settings)]
        check(f"spread target over {'+'.join(caches_on)} batched plain decoding", batched_plain == plains)
        for name, proposer in (
            ("eagle draft-vocab", EagleProposer(eagle, depth=3, top_k=2, total_tokens=6, draft_vocab=vocab)),
            ("medusa shared-lm_head", MedusaProposer(medusa, chain(2))),
        ):
            out = speculative_generate_batch(target.model, proposer, prompts, settings, kernels_kind)
            ok = [r.tokens for r in out] == plains
            check(f"spread target over {'+'.join(caches_on)} {kernels_kind} {name} batch of 3", ok)


def bench(fn: Callable[[], object], device) -> float:
    """Median milliseconds of fn."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[1]


def time_attention(batches, h, hkv, p, d, dtypes, device, gen) -> None:
    tree = medusa_tree(MC_SIM_7B_63, num_heads=4).to(device) if p > 64 else random_tree(16, gen).to(device)
    n = tree.num_nodes
    for dtype in dtypes:
        for b in batches:
            q, kp, vp, kt, vt = attention_inputs(b, h, hkv, p, n, d, dtype, device, gen)
            bits = tree.mask_bits.expand(b, -1, -1)
            group = h // hkv
            k_all = torch.cat([kp, kt], 2).repeat_interleave(group, 1)  # (B, H, P+N, D)
            v_all = torch.cat([vp, vt], 2).repeat_interleave(group, 1)
            mask = torch.zeros(b, 1, n, p + n, device=device, dtype=dtype)
            mask[..., p:] = torch.where(tree.dense_mask(), 0.0, float("-inf")).to(dtype)
            sdpa = functools.partial(F.scaled_dot_product_attention, q, k_all, v_all, attn_mask=mask, scale=d**-0.5)
            err = (sdpa().float() - reference.tree_attention(q, kp, vp, kt, vt, bits, d**-0.5).float()).abs().max()
            check(f"sdpa baseline {str(dtype)[6:]} B={b}", err.item() <= TOLERANCE[dtype], f"max abs err {err:.2e}")
            t_sdpa = bench(sdpa, device)
            tag = f"B={b} H={h}/{hkv} P={p} N={n} D={d} {str(dtype)[6:]}"
            for splits in (None, 1, 4, 8) if device.type == "cuda" else (None, 1):
                tree_attention = functools.partial(
                    kernels.tree_attention, q, kp, vp, kt, vt, bits, d**-0.5, num_splits=splits
                )
                t_tree = bench(tree_attention, device)
                label = "auto" if splits is None else splits
                print(
                    f"tree_attention/sdpa {tag} splits={label}: {t_tree / t_sdpa:.3f} (goal <= 1.0)"
                    f"  [{t_tree * 1e3:.1f} us vs {t_sdpa * 1e3:.1f} us]",
                    flush=True,
                )


def time_verify(b: int, vocab: int, device, gen) -> None:
    """Per-round verification cost on the MC_SIM_7B_63 tree: fused kernels vs the torch twins."""
    tree = medusa_tree(MC_SIM_7B_63, num_heads=4).to(device)
    n = tree.num_nodes
    logits = (3 * torch.randn(b, n, vocab, generator=gen)).to(device=device, dtype=torch.bfloat16)
    tokens = torch.randint(0, vocab, (b, n), generator=gen).to(device)
    coins = reference.draw_coins(tree, b).to(device)
    draft = torch.softmax(logits.float(), -1)
    for name in ("verify_greedy", "verify_typical", "verify_sampled"):
        args = (tokens, logits, tree) + ((coins, draft) if name == "verify_sampled" else ())
        times = {
            kind: bench(functools.partial(getattr(kernels.get_ops(kind), name), *args), device)
            for kind in ("triton", "reference")
        }
        print(
            f"{name} triton/reference B={b} N={n} V={vocab}: {times['triton'] / times['reference']:.3f}"
            f"  [{times['triton'] * 1e3:.1f} us vs {times['reference'] * 1e3:.1f} us]",
            flush=True,
        )


def section(name: str, fn: Callable[..., object], *args) -> None:
    """Run one part of the benchmark; an exception there is a failed check, and the rest still runs."""
    try:
        fn(*args)
    except Exception as exc:  # a crash in one section must not hide the others' results
        check(f"{name} (crashed)", False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    parser.add_argument("--timings", action="store_true", help="GPU: the timings alone (bf16), no checks")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    import triton

    print(f"torch {torch.__version__} triton {triton.__version__} Triton interpreter {kernels.INTERPRET}", flush=True)
    if args.smoke:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        section("attention", check_attention, [torch.float32, torch.float16], [(2, 4, 2, 37, 20, 32)], device, gen)
        section("verify", check_verify, 2, 20, 64, device, gen)
        section("lowrank", check_lowrank, 5, 300, 16, device, gen, [(torch.float32, 64)])
        section("attention timing", time_attention, [1], 4, 2, 40, 32, [torch.float32], device, gen)
        section("spread target", check_spread_target, ["cpu", "cpu"], ("reference", "triton"))
        section("batch decode", check_batch_decode, device, ("reference", "triton"))
        section("loader decode", check_loader_decode, device, gen)
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --smoke for the CPU interpreter check")
        if kernels.INTERPRET:
            sys.exit("TRITON_INTERPRET is set: the kernels would run in the interpreter; unset it for the GPU run")
        device = torch.device("cuda")
        print(f"device {torch.cuda.get_device_name()}", flush=True)
        if args.timings:  # a short lease: what the full run's checks leave no time for
            section("attention timing", time_attention, [1, 8], 32, 8, 4096, 128, [torch.bfloat16], device, gen)
            section("verify timing 128k", time_verify, 1, 128256, device, gen)
            section("verify timing 32k", time_verify, 1, 32000, device, gen)
            print(f"gpu_kernels/failed_checks: {len(FAILURES)} (goal == 0)", flush=True)
            sys.exit(1 if FAILURES else 0)
        shapes = [(2, 4, 2, 37, 20, 32), (2, 8, 2, 300, 64, 128), (3, 32, 8, 1000, 64, 128), (1, 4, 4, 0, 7, 64),
                  (1, 8, 4, 512, 64, 256)]  # fmt: skip
        section("attention", check_attention, [torch.bfloat16, torch.float16, torch.float32], shapes, device, gen)
        section("verify 32k", check_verify, 8, 64, 32000, device, gen)
        section("verify 128k", check_verify, 2, 64, 128256, device, gen)  # Llama-3's vocabulary
        section("verify 1k", check_verify, 3, 20, 1000, device, gen)
        lowrank_cases = [(torch.bfloat16, 256), (torch.bfloat16, 512), (torch.bfloat16, 1024), (torch.float32, 256)]
        section("lowrank", check_lowrank, 64, 128256, 64, device, gen, lowrank_cases)
        section("kv_commit", check_kv_commit, device, gen)
        section("loader decode", check_loader_decode, device, gen)
        section("batch decode", check_batch_decode, device, ("reference", "triton"))
        if torch.cuda.device_count() > 1:  # a target over two GPUs: both kernel paths
            section("spread target", check_spread_target, ["cuda:0", "cuda:1"], ("reference", "triton"))
        else:  # one GPU + the CPU (Triton kernels need every layer on a GPU): the reference path
            section("spread target", check_spread_target, ["cuda:0", "cpu"], ("reference",))
        half = [torch.bfloat16, torch.float16]
        section("attention timing", time_attention, [1, 8], 32, 8, 4096, 128, half, device, gen)
        section("verify timing 32k", time_verify, 1, 32000, device, gen)
        section("verify timing 128k", time_verify, 1, 128256, device, gen)
    if FAILURES:
        print("failed: " + ", ".join(FAILURES), flush=True)
    print(f"gpu_kernels/failed_checks: {len(FAILURES)} (goal == 0)", flush=True)
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()

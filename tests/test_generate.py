"""Speculative decoding loop: losslessness against plain decoding, stub and real drafters, τ bookkeeping.

TRITON_INTERPRET=1 .venv/bin/pytest tests/test_generate.py -q
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from accelerate.hooks import AlignDevicesHook

from eval import reference
from eval.baselines import plain_generate, plain_generate_batch, prompt_lookup_generate
from eval.checks import PerRow, RowProposer, ScriptedProposer, spread_layers
from eval.decode import DecodeSettings, round_stats, speculative_generate, speculative_generate_batch
from eval.eagle_proposer import EagleProposer
from eval.kernels import get_ops
from eval.proposal import DecodeState, VocabProjection
from eval.static_proposers import MedusaProposer
from eval.trees import MC_SIM_7B_63, Tree, chain, medusa_tree
from methods.eagle2.model import EagleConfig, EagleDrafter
from methods.medusa1.model import MedusaConfig, MedusaHeads
from models.target import load_target

TINY = {
    "llama": {"model_type": "llama", "rope_theta": 10000.0},
    "qwen2": {"model_type": "qwen2", "rope_theta": 1000000.0},
}


def tiny_target(family: str, vocab: int = 96, init_range: float = 0.2, seed: int = 0):
    config = {
        **TINY[family],
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "initializer_range": init_range,  # peaked distributions, so greedy continuations vary
        "tie_word_embeddings": False,
    }
    return load_target(random_init=config, dtype="float32", seed=seed)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: thread start-up dominates, and the machine's cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    return tiny_target(request.param)


PROMPT = torch.tensor([[5, 17, 3, 42, 8, 77, 23]])


TREE_SHAPES = {
    "chain4": [-1, 0, 1, 2, 3],
    "wide": [-1, 0, 0, 0, 1, 1, 2, 4, 4, 7],  # 3 children at the root, depth 4
}


@pytest.mark.parametrize("shape", sorted(TREE_SHAPES))
@pytest.mark.parametrize("mode", ["never", "always", "sometimes"])
def test_greedy_stub_lossless(target, shape, mode):
    settings = DecodeSettings(max_new_tokens=24)
    plain = plain_generate(target.model, PROMPT, settings)
    vocab = target.config.vocab_size
    stub = ScriptedProposer(plain.tokens, PROMPT.shape[1], TREE_SHAPES[shape], mode, vocab)
    out = speculative_generate(target.model, stub, PROMPT, settings)
    assert out.tokens == plain.tokens
    assert out.target_forwards == 1 + len(out.accepted)
    if mode == "never":
        assert out.accepted == [0] * (settings.max_new_tokens - 1)  # every branch rejected: one token per round
    if mode == "always":
        depth = Tree.from_parents(TREE_SHAPES[shape]).max_depth
        assert all(a == depth for a in out.accepted[:-1])  # the last round may run past the known continuation
        assert len(out.accepted) == -(-(settings.max_new_tokens - 1) // (depth + 1))


def test_greedy_stops_at_eos(target):
    plain = plain_generate(target.model, PROMPT, DecodeSettings(max_new_tokens=20))
    eos = plain.tokens[6]
    settings = DecodeSettings(max_new_tokens=20, eos_token_ids=[eos])
    stub = ScriptedProposer(plain.tokens, PROMPT.shape[1], TREE_SHAPES["chain4"], "always", 96)
    out = speculative_generate(target.model, stub, PROMPT, settings)
    assert out.tokens == plain.tokens[: plain.tokens.index(eos) + 1]
    assert out.tokens == plain_generate(target.model, PROMPT, settings).tokens


def test_a_sliding_window_target_decodes_within_its_window_and_is_refused_past_it():
    """Sliding-window cache layers keep only their last `window` positions, which tree verification and KV commit
    cannot work with: within the window the output is plain greedy's, past it an error names the window."""
    config = {"model_type": "mistral", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256,
              "initializer_range": 0.5, "tie_word_embeddings": False, "sliding_window": 40}  # fmt: skip
    model = load_target(random_init=config, dtype="float32", seed=0).model
    settings = DecodeSettings(max_new_tokens=20)
    plain = plain_generate(model, PROMPT, settings).tokens
    stub = ScriptedProposer(plain, PROMPT.shape[1], TREE_SHAPES["chain4"], "sometimes", 96)
    assert speculative_generate(model, stub, PROMPT, settings, "reference").tokens == plain
    long = torch.cat([PROMPT] * (41 // PROMPT.shape[1] + 1), dim=1)
    with pytest.raises(ValueError, match=r"sliding-window attention keeps 40 positions, this sequence needs"):
        speculative_generate(model, ScriptedProposer(plain, long.shape[1], [-1, 0], "never", 96), long, settings)


def test_prompt_lookup_decodes_by_the_same_rules_whatever_the_models_generation_config():
    """The prompt-lookup baseline runs transformers' `generate`, which would apply the model's own generation_config
    (here a repetition penalty and a minimum length): it must decode what plain greedy decoding decodes."""
    target = tiny_target("llama", seed=3)
    settings = DecodeSettings(max_new_tokens=20)
    plain = plain_generate(target.model, PROMPT, settings).tokens
    target.model.generation_config.repetition_penalty = 3.0
    target.model.generation_config.min_new_tokens = 20
    tokens, _ = prompt_lookup_generate(target.model, PROMPT, settings)
    assert tokens == plain


def _eagle(target, seed=0):
    torch.manual_seed(seed)
    return EagleDrafter(EagleConfig(), target.parts([-1])).eval()


def _medusa(target, num_heads=3, seed=0):
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig(num_heads=num_heads), target.parts([-1])).eval()
    with torch.no_grad():  # non-zero residual blocks: heads that differ from the target's own next-token head
        for p in heads.blocks.parameters():
            p.normal_(0, 0.1)
    return heads


@pytest.mark.parametrize(
    "kind",
    ["eagle_dynamic", "eagle_chain", "medusa_tree", "medusa_chain", "medusa_63"],
    ids=lambda k: k.replace("_", "-"),
)
def test_greedy_real_drafters_lossless(target, kind):
    settings = DecodeSettings(max_new_tokens=20)
    if kind == "eagle_dynamic":
        proposer = EagleProposer(_eagle(target), depth=3, top_k=3, total_tokens=8)
    elif kind == "eagle_chain":
        proposer = EagleProposer(_eagle(target), depth=4, top_k=1, total_tokens=5)
    elif kind == "medusa_tree":
        proposer = MedusaProposer(_medusa(target), medusa_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)], 3))
    elif kind == "medusa_chain":
        proposer = MedusaProposer(_medusa(target), chain(3))
    else:
        proposer = MedusaProposer(_medusa(target, num_heads=4), medusa_tree(MC_SIM_7B_63, 4))
    plain = plain_generate(target.model, PROMPT, settings)
    out = speculative_generate(target.model, proposer, PROMPT, settings)
    assert out.tokens == plain.tokens
    if kind == "eagle_chain":
        assert set(out.tree_nodes) == {5}


@pytest.mark.parametrize("kind", ["eagle_dynamic", "eagle_chain", "medusa_tree"])
def test_draft_vocabulary_keeps_greedy_output_and_drafts_only_from_it(target, kind):
    vocab = torch.randperm(target.model.config.vocab_size, generator=torch.Generator().manual_seed(0))[:64]
    if kind.startswith("eagle"):
        top_k, total = (3, 8) if kind == "eagle_dynamic" else (1, 4)
        proposer = EagleProposer(_eagle(target), depth=3, top_k=top_k, total_tokens=total, draft_vocab=vocab)
    else:
        proposer = MedusaProposer(_medusa(target), medusa_tree([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)], 3), vocab)
    drafted = []
    propose = proposer.propose
    proposer.propose = lambda states: drafted.extend(trees := propose(states)) or trees
    settings = DecodeSettings(max_new_tokens=20)
    out = speculative_generate(target.model, proposer, PROMPT, settings)
    assert out.tokens == plain_generate(target.model, PROMPT, settings).tokens
    assert drafted and all(set(t.tokens[1:].tolist()) <= set(vocab.tolist()) for t in drafted)


def test_draft_vocabulary_smaller_than_the_tree_top_k_is_refused():
    """Shards with fewer distinct loss tokens than the tree drafts per step would draft -inf nodes (EAGLE) or fail
    in topk (Medusa): both proposers refuse them up front."""
    target = tiny_target("llama")
    few = torch.tensor([3, 5, 7, 9])
    with pytest.raises(ValueError, match="4 tokens, fewer than the top 10"):
        MedusaProposer(_medusa(target, num_heads=4), medusa_tree(MC_SIM_7B_63, 4), few)
    with pytest.raises(ValueError, match="4 tokens, fewer than the top 5"):
        EagleProposer(_eagle(target), depth=3, top_k=5, total_tokens=10, draft_vocab=few)
    EagleProposer(_eagle(target), depth=3, top_k=4, total_tokens=10, draft_vocab=few)  # exactly enough


def test_vocab_projection_is_the_full_projection_restricted():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=True)
    ids = torch.tensor([7, 3, 41])
    vocab = VocabProjection(head, ids)
    h = torch.randn(2, 16)
    with torch.no_grad():
        assert torch.allclose(vocab(h), head(h)[:, ids], atol=1e-6)
        full = vocab.full_log_probs(vocab(h))
    assert full.shape == (2, 50) and torch.isinf(full[:, [0, 1, 2, 49]]).all()
    assert torch.allclose(full[:, ids], torch.log_softmax(head(h)[:, ids], -1).detach(), atol=1e-6)
    assert torch.allclose(full.exp().sum(-1), torch.ones(2))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_triton_path_matches_reference(family):
    """One switch selects the kernels; both paths give the same tokens and the same accepted lengths. The triton
    path runs the model under the registered tree attention and gives it back its own implementation afterwards."""
    target = tiny_target(family)  # its own instance: the triton path switches the model's attention
    settings = DecodeSettings(max_new_tokens=16)
    plain = plain_generate(target.model, PROMPT, settings)
    own = target.model.config._attn_implementation
    runs, seen = {}, []

    class Watching(ScriptedProposer):
        def propose_row(self, state):
            seen.append(target.model.config._attn_implementation)
            return super().propose_row(state)

    for kernels in ("reference", "triton"):
        stub = Watching(plain.tokens, PROMPT.shape[1], TREE_SHAPES["wide"], "sometimes", 96, seed=3)
        eagle = EagleProposer(_eagle(target), depth=3, top_k=2, total_tokens=6)
        runs[kernels] = [speculative_generate(target.model, p, PROMPT, settings, kernels) for p in (stub, eagle)]
        assert target.model.config._attn_implementation == own
    assert set(seen) == {own, "specdraft_tree"}
    for ref, tri in zip(runs["reference"], runs["triton"]):
        assert tri.tokens == ref.tokens == plain.tokens
        assert tri.accepted == ref.accepted
    assert sum(runs["triton"][0].accepted) > 0


def test_greedy_lossless_with_layers_spread_behind_device_hooks():
    """A target placed the way `device_map` places it (accelerate hooks per module, KV cache skipped by them) decodes
    losslessly on both kernel paths. Here every device is the CPU; `benchmarks/gpu_kernels.py` runs the same check
    over GPU + CPU (one GPU) or two GPUs, where the KV caches really live on different devices."""
    target = tiny_target("llama")
    settings = DecodeSettings(max_new_tokens=16)
    plain = plain_generate(target.model, PROMPT, settings)
    placement = spread_layers(target.model, ["cpu", "cpu"])
    assert placement["model.layers.0"] == placement["lm_head"] == torch.device("cpu")
    assert all(isinstance(m._hf_hook, AlignDevicesHook) for m in (target.model.model.layers[1], target.model.lm_head))
    assert plain_generate(target.model, PROMPT, settings).tokens == plain.tokens
    torch.manual_seed(0)
    shared = MedusaHeads(MedusaConfig(num_heads=2, share_lm_head=True), target.parts([-1])).eval()
    for kernels in ("reference", "triton"):
        stub = ScriptedProposer(plain.tokens, PROMPT.shape[1], TREE_SHAPES["wide"], "sometimes", 96, seed=3)
        out = speculative_generate(target.model, stub, PROMPT, settings, kernels)
        assert out.tokens == plain.tokens
        assert sum(out.accepted) > 0
        for proposer in (  # drafters that borrow the (hooked) lm_head
            EagleProposer(_eagle(target), depth=3, top_k=2, total_tokens=6, draft_vocab=torch.arange(0, 96, 2)),
            MedusaProposer(shared, chain(2)),
        ):
            assert speculative_generate(target.model, proposer, PROMPT, settings, kernels).tokens == plain.tokens
        eagle = EagleProposer(_eagle(target), depth=3, top_k=2, total_tokens=6)  # a batch of prompts of 3 lengths
        batch = speculative_generate_batch(target.model, eagle, BATCH_PROMPTS, settings, kernels)
        plains = [plain_generate(target.model, p[None], settings).tokens for p in BATCH_PROMPTS]
        assert [r.tokens for r in batch] == plains


def test_eagle_drafts_what_it_would_draft_alone(target):
    """The tree the proposer builds after a round equals a fresh drafter's tree over the same verified prefix:
    the drafter cache is committed correctly (tree steps cropped, accepted tokens re-run with target features)."""
    settings = DecodeSettings(max_new_tokens=8)
    drafter = _eagle(target)
    proposer = EagleProposer(drafter, depth=3, top_k=2, total_tokens=6)
    trees = []
    propose = proposer.propose
    proposer.propose = lambda states: trees.append((states[0].tokens.clone(), propose(states)[0])) or [trees[-1][1]]
    speculative_generate(target.model, proposer, PROMPT, settings)
    tokens, tree = trees[-1]
    fresh = EagleProposer(drafter, depth=3, top_k=2, total_tokens=6)
    hidden = target.hidden_states(tokens[:, :-1], layers=[-1])  # (1, L-1, 1, d)
    (again,) = fresh.propose([DecodeState(tokens=tokens, new_hidden=hidden)])
    assert torch.equal(again.tokens, tree.tokens) and torch.equal(again.parents, tree.parents)


@pytest.mark.parametrize("acceptance", ["exact", "typical"])
def test_sampled_real_drafters_run(target, acceptance):
    """Sampling (lossless rejection or lossy typical acceptance) with real drafters: the round bookkeeping holds."""
    settings = DecodeSettings(max_new_tokens=16, temperature=0.8, top_p=0.9, acceptance=acceptance, seed=1)
    for proposer in (
        EagleProposer(_eagle(target), depth=3, top_k=2, total_tokens=6),
        MedusaProposer(_medusa(target), medusa_tree([(0,), (1,), (0, 0)], 3)),
    ):
        out = speculative_generate(target.model, proposer, PROMPT, settings)
        assert len(out.tokens) == 16 and all(0 <= t < target.config.vocab_size for t in out.tokens)
        assert 1 + sum(a + 1 for a in out.accepted) >= 16 > sum(a + 1 for a in out.accepted[:-1])
        again = speculative_generate(target.model, proposer, PROMPT, settings)
        assert again.tokens == out.tokens  # seeded


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_sampled_speculative_decoding_equals_plain_sampling_with_the_same_coins(target, kernels):
    """Both decoders draw output position t with the same coin (`PositionCoins`), and target-only acceptance emits
    each token with its position's coin: on a float32 target, sampled speculative decoding gives plain sampling's
    tokens exactly, whatever the drafter proposes, one prompt or a batch: a lossless check as strict as greedy's."""
    for seed in (1, 2, 3):
        settings = DecodeSettings(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=seed)
        plain = plain_generate(target.model, PROMPT, settings).tokens
        for proposer in (
            EagleProposer(_eagle(target), depth=3, top_k=2, total_tokens=6),
            MedusaProposer(_medusa(target), medusa_tree([(0,), (1,), (0, 0)], 3)),
            ScriptedProposer(plain, PROMPT.shape[1], TREE_SHAPES["wide"], "sometimes", 96, seed=seed),
        ):
            out = speculative_generate(target.model, proposer, PROMPT, settings, kernels)
            assert out.tokens == plain, (seed, type(proposer).__name__)
    settings = DecodeSettings(max_new_tokens=12, temperature=1.0, seed=0)
    seeds = [5, 6, 7]
    plains = plain_generate_batch(target.model, BATCH_PROMPTS, settings, seeds)
    batch = speculative_generate_batch(
        target.model, EagleProposer(_eagle(target), depth=3, top_k=2, total_tokens=6), BATCH_PROMPTS, settings,
        kernels, seeds=seeds,
    )  # fmt: skip
    assert [b.tokens for b in batch] == [p.tokens for p in plains]
    alone = [
        plain_generate(target.model, p[None], dataclasses.replace(settings, seed=s))
        for p, s in zip(BATCH_PROMPTS, seeds)
    ]
    assert [p.tokens for p in plains] == [a.tokens for a in alone]


def test_round_stats_scripted():
    # the 3rd round accepted a whole branch (3 deep); the 4th stopped at a leaf at depth 1: neither is a rejection
    stats = round_stats(accepted=[0, 2, 3, 1], extendable=[True, True, False, False])
    assert stats["accept_len"] == pytest.approx((1 + 3 + 4 + 2) / 4)
    # depth 1: reached 4, passed 3; depth 2: reached by rounds 2, 3 (round 4's node had no child), passed 2;
    # depth 3: reached by rounds 2 (rejected there) and 3, passed 1
    assert stats["reached_by_depth"] == [4, 2, 2]
    assert stats["accept_rate_by_depth"] == pytest.approx([3 / 4, 1, 1 / 2])
    assert round_stats([], [])["rounds"] == 0


def test_generation_result_counts(target):
    settings = DecodeSettings(max_new_tokens=12)
    plain = plain_generate(target.model, PROMPT, settings)
    assert plain.target_forwards == 12 and plain.stats()["forwards_per_token"] == 1.0
    stub = ScriptedProposer(plain.tokens, PROMPT.shape[1], TREE_SHAPES["chain4"], "always", 96)
    out = speculative_generate(target.model, stub, PROMPT, settings)
    stats = out.stats()
    # 1 token from the prefill, then 5 + 5 per round; the stub knows 12 tokens, so the last round accepts 1
    assert out.accepted == [4, 4, 1] and stats["accept_len"] == pytest.approx(4.0) and stats["new_tokens"] == 12
    assert out.extendable == [False, False, True]  # whole chains accepted: nothing deeper was offered
    assert stats["reached_by_depth"] == [3, 3, 2, 2]
    assert stats["accept_rate_by_depth"] == pytest.approx([1, 2 / 3, 1, 1])
    assert stats["forwards_per_token"] == pytest.approx(4 / 12)
    assert out.wall_s >= out.target_s > 0


# --------------------------------------------------------------------------------------------
# Sampling: the output follows the target distribution


class FixedTreeProposer(RowProposer):
    """Deterministic drafts independent of the target's randomness: the same token tree every round."""

    def __init__(self, parents: list[int], tokens: list[int]):
        self.parents, self.tokens = parents, tokens

    def propose_row(self, state: DecodeState) -> Tree:
        return Tree.from_parents(self.parents, tokens=[int(state.tokens[0, -1])] + self.tokens)


SMALL_PROMPT = torch.tensor([[1, 3, 0]])


def _exact_joint(model, prompt: torch.Tensor, vocab: int, settings: DecodeSettings) -> torch.Tensor:
    """P(x1, x2) of the 2nd and 3rd generated tokens (the first two that go through verification), (V, V)."""
    x0, x1 = torch.meshgrid(torch.arange(vocab), torch.arange(vocab), indexing="ij")
    seqs = torch.cat([prompt.expand(vocab * vocab, -1), x0.reshape(-1, 1), x1.reshape(-1, 1)], dim=1)
    with torch.no_grad():
        logits = model(seqs).logits[:, -3:]  # (V*V, 3, V)
    p = reference.target_probs(logits, settings.temperature, settings.top_p)
    p0 = p[0, 0]  # (V,) first token
    p1 = p[::vocab, 1]  # (V x0, V) second token given x0
    p2 = p[:, 2].reshape(vocab, vocab, vocab)  # (x0, x1, x2)
    return torch.einsum("a,ab,abc->bc", p0, p1, p2)


def _empirical_joint(model, proposer, settings, ops, trials: int, vocab: int) -> torch.Tensor:
    counts = torch.zeros(vocab, vocab)
    for seed in range(trials):
        s = DecodeSettings(**{**vars(settings), "seed": seed})
        out = speculative_generate(model, proposer, SMALL_PROMPT, s, "reference", ops)
        counts[out.tokens[1], out.tokens[2]] += 1
    return counts / trials


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def test_sampled_follows_target_distribution():
    vocab, trials = 5, 800
    target = tiny_target("llama", vocab=vocab, init_range=0.5, seed=1)
    settings = DecodeSettings(max_new_tokens=3, temperature=0.8, top_p=0.95)
    exact = _exact_joint(target.model, SMALL_PROMPT, vocab, settings)
    # root -> {0, 1}; 0 -> {2, 3}; 1 -> {4}; 2 -> {1}: several children, deep paths, every token drafted somewhere
    proposer = FixedTreeProposer([-1, 0, 0, 1, 1, 2, 3], [0, 1, 2, 3, 4, 1])
    noise = 0.5 * float((2 * exact * (1 - exact) / (torch.pi * trials)).sqrt().sum())  # E[TV] of i.i.d. draws
    joint = _empirical_joint(target.model, proposer, settings, None, trials, vocab)
    assert _tv(joint.sum(1), exact.sum(1)) < 2 * noise  # the first verified token alone
    assert _tv(joint, exact) < 2 * noise, (_tv(joint, exact), noise)

    def forgetful_verify(tokens, logits, tree, coins, temperature=1.0, top_p=1.0):
        """A classic bug: after rejecting the drafts, the bonus is redrawn from p instead of the residual."""
        accept_len, nodes, _ = reference.verify_sampled(tokens, logits, tree, coins, None, temperature, top_p)
        last = nodes[0, accept_len[0]]
        p = reference.target_probs(logits[0, last], temperature, top_p)
        return accept_len, nodes, reference.sample_from(p[None], coins[:, -1, -1])

    perturbed = dataclasses.replace(get_ops("reference"), verify_sampled=forgetful_verify)
    bad = _tv(_empirical_joint(target.model, proposer, settings, perturbed, trials, vocab), exact)
    assert bad > 3 * noise, (bad, noise)


# --------------------------------------------------------------------------------------------
# Batches: rows of different lengths accepting different lengths (a ragged KV cache)

BATCH_PROMPTS = [PROMPT[0], torch.tensor([9, 4, 61]), torch.tensor([30, 2, 2, 71, 11, 5, 90, 14, 3, 66, 8, 19])]


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_batch_greedy_stub_lossless_with_ragged_rows(target, kernels):
    """Three prompts of different lengths (a padded prefill) whose drafts are never / always / sometimes right, so
    their caches grow apart every round and rows finish in different rounds: every row equals plain greedy decoding
    of its prompt alone, with exactly the rounds it would take alone."""
    settings = DecodeSettings(max_new_tokens=20)
    plains = [plain_generate(target.model, p[None], settings) for p in BATCH_PROMPTS]
    modes = ["never", "always", "sometimes"]

    def stubs():
        return [
            ScriptedProposer(plain.tokens, len(p), TREE_SHAPES["wide"], mode, 96, seed=5)
            for plain, p, mode in zip(plains, BATCH_PROMPTS, modes)
        ]

    batch = speculative_generate_batch(target.model, PerRow(stubs()), BATCH_PROMPTS, settings, kernels)
    alone = [
        speculative_generate(target.model, stub, p[None], settings, kernels) for stub, p in zip(stubs(), BATCH_PROMPTS)
    ]
    for row, (out, plain, single) in enumerate(zip(batch, plains, alone)):
        assert out.tokens == plain.tokens, row
        assert out.accepted == single.accepted and out.extendable == single.extendable, row
        assert out.target_forwards == 1 + len(out.accepted)
    assert batch[0].accepted == [0] * 19 and len(batch[1].accepted) < len(batch[2].accepted) < 19
    assert batch[0].wall_s == batch[1].wall_s >= batch[0].target_s > 0  # the batch's times, shared


@pytest.mark.parametrize("kind", ["eagle_dynamic", "eagle_vocab", "medusa_tree"])
@pytest.mark.parametrize("batched", [True, False], ids=["one-proposer", "per-row"])
def test_batch_greedy_real_drafters_lossless(target, kind, batched):
    """Real drafters over a batch, either one proposer drafting every row in the same forwards (EAGLE's ragged
    drafter cache, Medusa's heads over all rows) or one proposer per row: every row equals plain greedy decoding and
    accepts, round by round, what it accepts alone, so each row's drafts are the ones it would get alone."""
    settings = DecodeSettings(max_new_tokens=16)
    drafter = _medusa(target) if kind == "medusa_tree" else _eagle(target)
    tree = medusa_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)], 3)
    vocab = torch.arange(0, 96, 2) if kind == "eagle_vocab" else None

    def make():
        if kind == "medusa_tree":
            return MedusaProposer(drafter, tree)
        return EagleProposer(drafter, depth=3, top_k=2, total_tokens=6, draft_vocab=vocab)

    proposer = make() if batched else PerRow([make() for _ in BATCH_PROMPTS])
    batch = speculative_generate_batch(target.model, proposer, BATCH_PROMPTS, settings)
    for row, (out, p) in enumerate(zip(batch, BATCH_PROMPTS)):
        assert out.tokens == plain_generate(target.model, p[None], settings).tokens, row
        assert out.accepted == speculative_generate(target.model, make(), p[None], settings).accepted, row


@pytest.mark.parametrize("vocab", [None, torch.arange(0, 96, 2)], ids=["full-vocab", "draft-vocab"])
def test_batched_eagle_drafts_what_each_row_drafts_alone(target, vocab):
    """One EagleProposer for three rows whose prompts differ in length and whose rounds verify different numbers of
    tokens (its ragged drafter cache is padded, packed, cropped, and loses a row midway) drafts for every row, round
    after round, the tree a proposer of that row alone drafts."""
    drafter = _eagle(target)
    make = lambda: EagleProposer(drafter, depth=3, top_k=2, total_tokens=6, draft_vocab=vocab)  # noqa: E731
    batch, alone = make(), [make() for _ in BATCH_PROMPTS]
    gen = torch.Generator().manual_seed(4)
    seqs = [p.clone() for p in BATCH_PROMPTS]
    new = [len(p) - 1 for p in seqs]  # the prefill: every prompt position but the root
    rows = [0, 1, 2]
    batch.reset(3)
    for proposer in alone:
        proposer.reset(1)
    for step, accepted in enumerate([None, [2, 0, 3], [0, 3, 1], [1, 1, 0], [3, 2, 2]]):
        if accepted is not None:  # each row verified accepted + 1 more tokens
            for b in rows:
                seqs[b] = torch.cat([seqs[b], torch.randint(0, 96, (accepted[b] + 1,), generator=gen)])
                new[b] = accepted[b] + 1
        states = []
        for b in rows:
            tokens = seqs[b][None]
            hidden = target.hidden_states(tokens[:, :-1], layers=[-1])[:, -new[b] :]  # (1, n_b, 1, d)
            states.append(DecodeState(tokens=tokens, new_hidden=hidden))
        trees = batch.propose(states)
        for b, state, tree in zip(rows, states, trees):
            (want,) = alone[b].propose([state])
            assert torch.equal(tree.tokens, want.tokens) and torch.equal(tree.parents, want.parents), (step, b)
        batch.commit([[0]] * len(rows))
        for b in rows:
            alone[b].commit([[0]])
        if step == 2:  # row 1 finishes
            batch.keep_rows([0, 2])
            rows = [0, 2]
    assert batch.lengths == [len(seqs[0]) - 1, len(seqs[2]) - 1]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_plain_batch_equals_plain_alone(target, temperature):
    """The batch-B plain baseline (left-padded HF-style batched decoding, rows leaving at EOS) gives every row the
    tokens, and the forward count, of plain decoding of its prompt alone with the row's seed, sampled included."""
    settings = DecodeSettings(max_new_tokens=12, temperature=temperature, seed=3)
    alone = [
        plain_generate(target.model, p[None], dataclasses.replace(settings, seed=3 + b))
        for b, p in enumerate(BATCH_PROMPTS)
    ]
    eos = alone[1].tokens[4]  # row 1 stops early (others too, wherever they emit it)
    settings = dataclasses.replace(settings, eos_token_ids=[eos])
    alone = [
        plain_generate(target.model, p[None], dataclasses.replace(settings, seed=3 + b))
        for b, p in enumerate(BATCH_PROMPTS)
    ]
    batch = plain_generate_batch(target.model, BATCH_PROMPTS, settings)
    for out, single in zip(batch, alone):
        assert out.tokens == single.tokens and out.target_forwards == single.target_forwards
        assert out.accepted == [] and out.stats()["forwards_per_token"] == 1.0
    assert len(batch[1].tokens) <= 5 < max(len(out.tokens) for out in batch)


def test_plain_batch_positions_and_padding_follow_each_row(target):
    """Left padding never shifts a row's positions: its prompt sits at 0..L_b-1 and its t-th new token at L_b + t - 1,
    before and after the longest row leaves; then the padding nobody needs is cropped from the cache and mask."""
    settings = DecodeSettings(max_new_tokens=10)
    plains = [plain_generate(target.model, p[None], settings).tokens for p in BATCH_PROMPTS]
    eos = next(t for t in plains[2][1:5] if t not in plains[0] + plains[1])  # the longest prompt leaves early
    settings = dataclasses.replace(settings, eos_token_ids=[eos])
    seen = []
    hook = target.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs["position_ids"].clone(), kwargs["attention_mask"].clone())),
        with_kwargs=True,
    )
    try:
        out = plain_generate_batch(target.model, BATCH_PROMPTS, settings)
    finally:
        hook.remove()
    lengths = [len(p) for p in BATCH_PROMPTS]
    assert len(out[2].tokens) < 5 < len(out[0].tokens) == len(out[1].tokens) == 10
    positions, mask = seen[0]
    assert [positions[b][mask[b] == 1].tolist() for b in range(3)] == [list(range(n)) for n in lengths]
    for t, (positions, mask) in enumerate(seen[1:], 1):
        active = [b for b in range(3) if len(out[b].tokens) > t]
        assert positions[:, 0].tolist() == [lengths[b] + t - 1 for b in active]
        assert mask.shape == (len(active), max(lengths[b] for b in active) + t)  # no column only padding


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_sampled_batch_rows_decode_what_they_decode_alone(target, kind):
    """With per-row generators and per-row uniforms, a sampled (or typical-acceptance) row of a batch decodes exactly
    what it decodes alone with its seed: batch size and neighbours do not change outputs."""
    make = {
        "eagle": lambda: EagleProposer(_eagle(target), depth=3, top_k=2, total_tokens=6),
        "medusa": lambda: MedusaProposer(_medusa(target), medusa_tree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)], 3)),
    }[kind]
    for acceptance in ("exact", "typical"):
        settings = DecodeSettings(max_new_tokens=14, temperature=0.9, top_p=0.95, acceptance=acceptance, seed=11)
        batch = speculative_generate_batch(target.model, make(), BATCH_PROMPTS, settings, seeds=[5, 6, 7])
        for b, (out, p) in enumerate(zip(batch, BATCH_PROMPTS)):
            single = speculative_generate(target.model, make(), p[None], dataclasses.replace(settings, seed=5 + b))
            assert out.tokens == single.tokens and out.accepted == single.accepted, (acceptance, b)


def test_one_prompt_proposer_refuses_a_batch(target):
    stub = FixedTreeProposer([-1, 0], [1])
    with pytest.raises(ValueError, match="drafts for one prompt"):
        speculative_generate_batch(target.model, stub, BATCH_PROMPTS[:2], DecodeSettings(max_new_tokens=4))


def test_batch_rows_finish_at_eos_and_leave_the_batch(target):
    """A row that hits EOS stops there (its tokens end with it) while the others go on to max_new_tokens; the
    batch's target forwards run only over rows still decoding."""
    settings = DecodeSettings(max_new_tokens=20)
    plains = [plain_generate(target.model, p[None], settings).tokens for p in BATCH_PROMPTS]
    eos = next(t for t in plains[1][2:] if all(t not in other for other in (plains[0], plains[2])))
    settings = DecodeSettings(max_new_tokens=20, eos_token_ids=[eos])
    stubs = [ScriptedProposer(t, len(p), TREE_SHAPES["chain4"], "sometimes", 96) for t, p in zip(plains, BATCH_PROMPTS)]
    rows = []
    hook = target.model.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        out = speculative_generate_batch(target.model, PerRow(stubs), BATCH_PROMPTS, settings)
    finally:
        hook.remove()
    assert out[1].tokens == plains[1][: plains[1].index(eos) + 1]
    assert out[0].tokens == plains[0] and out[2].tokens == plains[2]
    assert rows[0] == 3 and min(rows) < 3  # the prefill over all three, later rounds over fewer
    assert rows == sorted(rows, reverse=True)


def test_batch_is_refused_with_a_clear_error_when_malformed(target):
    settings = DecodeSettings(max_new_tokens=4)
    stub = lambda parents: FixedTreeProposer(parents, [1] * (len(parents) - 1))  # noqa: E731
    with pytest.raises(ValueError, match="one proposer per prompt"):
        speculative_generate_batch(target.model, PerRow([stub([-1, 0])]), BATCH_PROMPTS[:2], settings)
    same = stub([-1, 0])
    with pytest.raises(ValueError, match="distinct proposer"):
        speculative_generate_batch(target.model, PerRow([same, same]), BATCH_PROMPTS[:2], settings)
    with pytest.raises(ValueError, match=r"same node count, got \{0: 2, 1: 3\}"):
        speculative_generate_batch(target.model, PerRow([stub([-1, 0]), stub([-1, 0, 1])]), BATCH_PROMPTS[:2], settings)
    with pytest.raises(ValueError, match="speculative_generate_batch"):
        speculative_generate(target.model, stub([-1, 0]), torch.stack([PROMPT[0], PROMPT[0]]), settings)


def test_batch_sampled_row_follows_target_distribution():
    """Lossless sampling survives the ragged layout: SMALL_PROMPT decoded in a batch behind a longer prompt (so its
    prefill is padded and its cache later holds stale rows) still reproduces the target's joint of its first two
    verified tokens."""
    vocab, trials = 5, 800
    target = tiny_target("llama", vocab=vocab, init_range=0.5, seed=1)
    settings = DecodeSettings(max_new_tokens=3, temperature=0.8, top_p=0.95)
    exact = _exact_joint(target.model, SMALL_PROMPT, vocab, settings)
    parents, drafts = [-1, 0, 0, 1, 1, 2, 3], [0, 1, 2, 3, 4, 1]
    noise = 0.5 * float((2 * exact * (1 - exact) / (torch.pi * trials)).sqrt().sum())
    prompts = [torch.tensor([2, 4, 1, 1, 3, 0]), SMALL_PROMPT[0]]
    counts = torch.zeros(vocab, vocab)
    for seed in range(trials):
        s = DecodeSettings(**{**vars(settings), "seed": seed})
        rows = [FixedTreeProposer(parents, drafts), FixedTreeProposer(parents, drafts[::-1])]
        out = speculative_generate_batch(target.model, PerRow(rows), prompts, s)[1]
        counts[out.tokens[1], out.tokens[2]] += 1
    joint = counts / trials
    assert _tv(joint.sum(1), exact.sum(1)) < 2 * noise
    assert _tv(joint, exact) < 2 * noise, (_tv(joint, exact), noise)

    # rows draw independently: two copies of one prompt agree on the first verified token only by chance
    same, runs = 0, 300
    for seed in range(runs):
        s = DecodeSettings(**{**vars(settings), "seed": seed})
        rows = [FixedTreeProposer(parents, drafts), FixedTreeProposer(parents, drafts)]
        out = speculative_generate_batch(target.model, PerRow(rows), [SMALL_PROMPT[0], SMALL_PROMPT[0]], s)
        same += out[0].tokens[1] == out[1].tokens[1]
    p1 = exact.sum(1)
    chance = float((p1**2).sum())
    assert abs(same / runs - chance) < 4 * (chance * (1 - chance) / runs) ** 0.5, (same / runs, chance)

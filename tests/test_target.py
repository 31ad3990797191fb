"""Target loading and hook-based hidden-state capture: `pytest tests/test_target.py`."""

from __future__ import annotations

import pytest
import torch

from models.target import load_target

TOKENIZER = "recipes/pocket/target"
TINY = dict(
    vocab_size=8192,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def tiny_target(model_type: str = "llama", dtype: str = "float32", seed: int = 0, **overrides):
    return load_target(
        random_init={"model_type": model_type, **TINY, **overrides}, tokenizer=TOKENIZER, dtype=dtype, seed=seed
    )


def padded_batch(lengths: list[int], vocab: int = 8192, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded random token batch: (B, T) ids and (B, T) attention mask."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
        ids[b, n:] = 2  # pad token
    return ids, mask


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_hidden_states_match_output_hidden_states(model_type: str) -> None:
    target = tiny_target(model_type)
    ids, mask = padded_batch([11, 7, 3])
    with torch.inference_mode():
        ref = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        L = target.num_layers
        assert len(ref) == L + 1
        for index in [0, 1, 2, L, -1]:
            got = target.hidden_states(ids, mask, layers=[index])  # (B, T, 1, d)
            assert got.shape == (3, 11, 1, 64)
            torch.testing.assert_close(got[:, :, 0], ref[index], rtol=0, atol=0)
        # several layers at once, in the requested order (not sorted)
        got = target.hidden_states(ids, mask, layers=[-1, 0, 2])
        for slot, index in enumerate([-1, 0, 2]):
            torch.testing.assert_close(got[:, :, slot], ref[index], rtol=0, atol=0)


def test_forward_stops_after_deepest_layer_and_skips_lm_head() -> None:
    target = tiny_target()
    calls: list[str] = []
    target.base.layers[1].register_forward_hook(lambda *a: calls.append("layer1"))
    target.base.layers[2].register_forward_hook(lambda *a: calls.append("layer2"))
    target.lm_head.register_forward_hook(lambda *a: calls.append("lm_head"))
    ids, mask = padded_batch([5, 5])
    with torch.inference_mode():
        target.hidden_states(ids, mask, layers=[0, 2])  # index 2 = input of layer 2: layer 1 runs, layer 2 does not
        assert calls == ["layer1"]
        calls.clear()
        target.hidden_states(ids, mask, layers=[-1])
        assert calls == ["layer1", "layer2"]
    # hooks are removed and the aborted forward left no state behind: a plain forward is unaffected
    assert not target.base.layers[0]._forward_pre_hooks
    with torch.inference_mode():
        out = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert len(out.hidden_states) == 4 and out.logits.shape == (2, 5, 8192)


def test_load_is_frozen_seeded_and_identity_tracks_weights() -> None:
    a, b, c = tiny_target(seed=0), tiny_target(seed=0), tiny_target(seed=1)
    assert not a.model.training
    assert not any(p.requires_grad for p in a.model.parameters())
    assert a.tokenizer is not None and a.tokenizer.pad_token == "<|pad|>"
    assert a.num_layers == 3 and a.embed_tokens.weight.shape == (8192, 64) and a.lm_head.weight.shape == (8192, 64)
    assert a.identity() == b.identity()
    assert a.identity()["weights_sha256"] != c.identity()["weights_sha256"]
    assert a.identity()["config_sha256"] == c.identity()["config_sha256"]
    bf16 = tiny_target(dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16 and bf16.identity()["dtype"] == "bfloat16"
    # bf16 weights are the float32 draw rounded, not a different draw
    torch.testing.assert_close(bf16.embed_tokens.weight, a.embed_tokens.weight.to(torch.bfloat16), rtol=0, atol=0)


def test_parts_and_layer_validation() -> None:
    target = tiny_target()
    parts = target.parts([0, -1])
    assert parts.stored_layers == [0, -1]
    assert parts.embed_tokens is target.embed_tokens and parts.lm_head is target.lm_head
    with pytest.raises(ValueError, match="out of range"):
        target.parts([4])
    with pytest.raises(ValueError, match="out of range"):
        target.hidden_states(torch.zeros(1, 2, dtype=torch.long), layers=[-2])


def test_path_roundtrip_and_unsupported_architecture(tmp_path) -> None:
    target = tiny_target()
    target.model.save_pretrained(tmp_path / "model")
    loaded = load_target(path=str(tmp_path / "model"), dtype="float32")
    assert loaded.tokenizer is None  # no tokenizer files there, and none was asked for
    assert {k: v for k, v in loaded.identity().items() if k != "name"} == {
        k: v for k, v in target.identity().items() if k != "name"
    }
    with pytest.raises(ValueError, match="unsupported target architecture"):
        load_target(
            random_init={"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 128},
            dtype="float32",
        )
    with pytest.raises(ValueError, match="exactly one"):
        load_target()


def test_a_random_bf16_target_computes_what_its_saved_copy_computes(tmp_path):
    """Random-init targets cast their parameters only: RoPE's inv_freq stays float32, as from_pretrained keeps it,
    so the same weights saved and reloaded give the same hidden states (a bf16 inv_freq moved them by ~0.05)."""
    from transformers import AutoModelForCausalLM

    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4}  # fmt: skip
    target = load_target(random_init=config, dtype="bfloat16")
    assert all(b.dtype == torch.float32 for name, b in target.model.named_buffers() if "inv_freq" in name)
    target.model.save_pretrained(tmp_path)
    copy = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    ids = torch.randint(0, 64, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(target.model(ids).logits, copy(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("model_type,tied", [("llama", True), ("qwen2", False), ("mistral", False)])
def test_checkpoint_identity_is_the_loaded_targets_without_loading_it(tmp_path, model_type, tied) -> None:
    """An engine-served target's features record the identity the transformers path records: read from the
    safetensors tensor by tensor (tied embeddings, several shards, a dtype cast), equal to `identity()`."""
    from models.target import TargetError, checkpoint_identity

    target = tiny_target(model_type, tie_word_embeddings=tied)
    target.model.save_pretrained(tmp_path / "model", max_shard_size="200KB")  # several safetensors files
    assert len(list((tmp_path / "model").glob("*.safetensors"))) > 1
    for dtype in ("float32", "bfloat16"):
        loaded = load_target(path=str(tmp_path / "model"), dtype=dtype)
        assert checkpoint_identity(str(tmp_path / "model"), dtype) == loaded.identity()
    other = tiny_target(model_type, seed=1, tie_word_embeddings=tied)
    other.model.save_pretrained(tmp_path / "other")
    assert (
        checkpoint_identity(str(tmp_path / "other"), "float32")["weights_sha256_whole"]
        != (checkpoint_identity(str(tmp_path / "model"), "float32")["weights_sha256_whole"])
    )
    from safetensors.torch import load_file, save_file

    for file in (tmp_path / "other").glob("*.safetensors"):  # a checkpoint that lost a tensor
        tensors = load_file(file)
        save_file({k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}, file, {"format": "pt"})
    with pytest.raises(TargetError, match=r"no tensor 'model.layers.1.mlp.up_proj.weight'"):
        checkpoint_identity(str(tmp_path / "other"), "float32")
    with pytest.raises(TargetError, match="target.path: .*nowhere"):
        checkpoint_identity(str(tmp_path / "nowhere"), "float32")


def test_process_gpus_are_disjoint_equal_shares():
    from models.target import TargetError, process_gpus

    assert process_gpus(0, 2, 8) == [0, 1, 2, 3] and process_gpus(1, 2, 8) == [4, 5, 6, 7]
    assert process_gpus(0, 1, 0) == []
    with pytest.raises(TargetError, match="at most one process per GPU"):
        process_gpus(0, 4, 2)

"""Shared builders for drafter tests: a tiny random Llama target and feature batches computed from it."""

from __future__ import annotations

import socket
import sys

import torch
from accelerate.state import AcceleratorState, GradientState
from transformers import LlamaConfig, LlamaForCausalLM

from models.common import DraftBatch


def reset_accelerate() -> None:
    """Forget accelerate's process-wide state: each in-process run builds its own Accelerator."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """Vocab 256, d 64, 2 layers, 4 heads / 2 KV heads, random weights under `seed`."""
    torch.manual_seed(seed)
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config = LlamaConfig(**{**shape, "num_key_value_heads": 2, **overrides})
    return LlamaForCausalLM(config).eval()


def trainable_names(module: torch.nn.Module) -> list[str]:
    """Names of the parameters a drafter trains (requires_grad), in registration order."""
    return [name for name, p in module.named_parameters() if p.requires_grad]


def perturbed(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """`module` in eval mode with its trainable parameters moved off their initialisation (seeded), so that exports
    and reloads of it are compared on non-trivial weights."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return module.eval()


def make_samples(lengths: list[int], seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids (T,), loss_mask (T,)): a short prompt without loss, then assistant tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for T in lengths:
        ids = torch.randint(0, 256, (T,), generator=g)
        mask = torch.ones(T)
        mask[: T // 3] = 0
        out.append((ids, mask))
    return out


@torch.no_grad()
def sample_hidden(model: LlamaForCausalLM, ids: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """(T, n_layers, d) hidden states of one sample run alone through the target."""
    hs = model(ids[None], output_hidden_states=True).hidden_states
    return torch.stack([hs[layer][0] for layer in layers], dim=1)


def make_batch(model, samples, layers: list[int], rows: list[list[int]], width: int) -> DraftBatch:
    """Rows of packed samples (indices into `samples`), right-padded to `width`."""
    B, d = len(rows), model.config.hidden_size
    batch = DraftBatch(
        input_ids=torch.zeros(B, width, dtype=torch.long),
        loss_mask=torch.zeros(B, width),
        attention_mask=torch.zeros(B, width, dtype=torch.long),
        position_ids=torch.zeros(B, width, dtype=torch.long),
        hidden=torch.zeros(B, width, len(layers), d),
    )
    for b, row in enumerate(rows):
        start = 0
        for i in row:
            ids, mask = samples[i]
            sl = slice(start, start + ids.shape[0])
            batch["input_ids"][b, sl] = ids
            batch["loss_mask"][b, sl] = mask
            batch["attention_mask"][b, sl] = 1
            batch["position_ids"][b, sl] = torch.arange(ids.shape[0])
            batch["hidden"][b, sl] = sample_hidden(model, ids, layers)
            start += ids.shape[0]
    return batch


def save_chat_target(path, tokenizer_dir) -> None:
    """A 2-layer random Llama (vocab 8192) saved with the tokenizer of `tokenizer_dir` (the pocket one, which has a
    chat template). A large init makes the next-token distributions peaked, so greedy choices are far from ties."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        initializer_range=0.5,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)


def drafted_trees(model, proposer, prompt: torch.Tensor, settings) -> tuple[list[int], list[list[int]]]:
    """Speculative decoding of `prompt` with `proposer`: (the output tokens, the token ids of every tree it proposed,
    root first)."""
    from eval.decode import speculative_generate

    trees = []
    propose = proposer.propose
    proposer.propose = lambda states: trees.extend(t := propose(states)) or t
    tokens = speculative_generate(model, proposer, prompt, settings).tokens
    return tokens, [t.tokens.tolist() for t in trees]


def accelerate_launch(*args: str) -> list[str]:
    """`accelerate launch ARGS` on a free local port, so that no two launching tests share accelerate's default
    29500."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(port), *args]


def cut_map(num_layers: int) -> dict[str, str]:
    """A `device_map` that cuts a Llama-like target into pieces on a machine without GPUs: every other decoder layer
    offloaded to "disk" (accelerate's hooks read its weights for each forward, the model never holds them), the rest
    on the CPU, with the embedding and the head (what drafters borrow) on the CPU."""
    placement = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    return placement | {f"model.layers.{i}": "disk" if i % 2 else "cpu" for i in range(num_layers)}


def count_offloaded_loads(monkeypatch) -> list[str]:
    """Record (by module class) every time accelerate's hooks bring an offloaded module's weights in for a forward
    (the hooks sit on the leaves: Linear, RMSNorm): proof that a `cut_map` run really ran layers from the disk, not a
    whole target left in place."""
    from accelerate.hooks import AlignDevicesHook

    loads: list[str] = []
    onload = AlignDevicesHook._onload_weights

    def counting(self, module):
        loads.append(type(module).__name__)
        return onload(self, module)

    monkeypatch.setattr(AlignDevicesHook, "_onload_weights", counting)
    return loads

"""How much memory a target takes through the pipeline, from its `config.json` alone (no weights read):

    python -m models.memory artifacts/smollm2-135m-instruct --draft-vocab 32000 --tokens 4096 --processes 8
    python -m models.memory path/to/llama-3.1-70b/config.json --processes 16 --sharding zero3

Counts are exact for Llama-family decoders (Llama, Qwen2, Mistral: attention, SwiGLU MLP, RMSNorm; Qwen2's q/k/v
biases counted); activations are an estimate. What it prints, per process:

- extraction, self-distillation and online training: the target's weights in its dtype, whole on every process
  (unless `target.device_map` spreads it over a process's GPUs, or vLLM holds it: docs/scaling.md);
- EAGLE-3 training from feature shards: the target's embedding (borrowed, frozen), the drafter's trainable weights
  with their gradients and AdamW state in fp32 (16 bytes a parameter; ZeRO-2 shards gradients and moments over the
  processes, ZeRO-3 and FSDP everything), and the activations of `--tokens` tokens per process, unrolled
  `--ttt-steps` times. Per token and unrolled step the activations take about LOGIT_COPIES fp32 copies of the draft
  vocabulary's logits plus HIDDEN_COPIES of the hidden width: constants fitted to the SmolLM2 EAGLE-3.1 step
  measured by benchmarks/long_train.py (0.79 / 1.48 / 2.80 / 4.95 GB added at 1k / 2k / 4k / 8k tokens), one
  decoder layer; a drafter of `--num-layers` counts the hidden-width part once per layer (an estimate, unmeasured);
- the feature store on disk, per token, for the stored layers (3 fused + the last) at `--storage-bytes`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

GB = 1e9
LOGIT_COPIES = 2.0
"""fp32 copies of the draft logits per token and unrolled step (logits and log-softmax kept for backward; the target's
distribution over the draft vocabulary and the gradients come and go)."""
HIDDEN_COPIES = 28.0
"""fp32 copies of the hidden width per token and unrolled step (layer inputs, attention projections, the MLP's
intermediate-width tensors counted in units of the hidden width, norms, residuals). With LOGIT_COPIES, fitted to the
measured growth of 580 KB per token over 3 unrolled steps at a 16,000-token draft vocabulary, d 576."""
ADAM_BYTES = 16
"""fp32 weight + gradient + two AdamW moments, per trainable parameter."""


class MemoryError_(ValueError):
    """A config this estimate cannot read; the message names the file and key."""


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool
    dtype_bytes: int


def read_config(path: str | Path) -> tuple[Path, dict]:
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        return file, json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MemoryError_(f"{file}: no such file (a model directory or its config.json)") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise MemoryError_(f"{file}: not a readable JSON config ({exc})") from None


def shape_of(config: dict, source: str = "config") -> Shape:
    def need(key: str) -> int:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MemoryError_(f"{source}: {key}: a positive integer is needed, got {value!r}")
        return value

    d, heads = need("hidden_size"), need("num_attention_heads")
    kv = config.get("num_key_value_heads") or heads
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return Shape(
        hidden=d,
        layers=need("num_hidden_layers"),
        intermediate=need("intermediate_size"),
        vocab=need("vocab_size"),
        heads=heads,
        kv_heads=kv,
        head_dim=config.get("head_dim") or d // heads,
        tied=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
        dtype_bytes=4 if dtype in ("float32", "torch.float32") else 2,
    )


def _attention(s: Shape, in_dim: int, bias: bool) -> int:
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    bias = (q + 2 * kv) if bias else 0
    return in_dim * (q + 2 * kv) + q * s.hidden + bias


def target_params(s: Shape) -> int:
    """Every parameter of the target (its embedding, decoder layers, final norm and, untied, its LM head)."""
    layer = _attention(s, s.hidden, s.qkv_bias) + 3 * s.hidden * s.intermediate + 2 * s.hidden
    return s.vocab * s.hidden * (1 if s.tied else 2) + s.layers * layer + s.hidden


def eagle3_trainable(s: Shape, draft_vocab: int, fused: int = 3, fc_norm: bool = True, num_layers: int = 1) -> int:
    """The EAGLE-3 drafter's trainable parameters: fc over the fused features, a first decoder layer whose attention
    reads [embedding; feature] (2d, no biases whatever the target has) and its three norms, `num_layers - 1` plain
    layers after it (two norms each), the final norm and its own LM head over the draft vocabulary."""
    first = _attention(s, 2 * s.hidden, bias=False) + 3 * s.hidden * s.intermediate + 3 * s.hidden
    plain = _attention(s, s.hidden, bias=False) + 3 * s.hidden * s.intermediate + 2 * s.hidden
    norms = fused * s.hidden if fc_norm else 0
    layers = first + (num_layers - 1) * plain
    return fused * s.hidden * s.hidden + norms + layers + s.hidden + draft_vocab * s.hidden


def estimate(
    s: Shape,
    *,
    draft_vocab: int = 32000,
    tokens: int = 4096,
    ttt_steps: int = 7,
    num_layers: int = 1,
    processes: int = 1,
    sharding: str = "none",
    storage_bytes: int = 2,
) -> dict[str, float]:
    """Bytes (GB) per process for each step; see the module docstring."""
    weights = target_params(s) * s.dtype_bytes
    trainable = eagle3_trainable(s, draft_vocab, num_layers=num_layers)
    state = trainable * ADAM_BYTES
    if sharding == "zero2":
        state = trainable * 4 + trainable * (ADAM_BYTES - 4) / processes  # weights whole, the rest sharded
    elif sharding in ("zero3", "fsdp"):
        state /= processes
    per_token = ttt_steps * 4 * (LOGIT_COPIES * draft_vocab + num_layers * HIDDEN_COPIES * s.hidden)
    return {
        "target_gb": weights / GB,
        "drafter_trainable_m": trainable / 1e6,
        "train_embedding_gb": s.vocab * s.hidden * s.dtype_bytes / GB,
        "train_state_gb": state / GB,
        "train_activations_gb": tokens * per_token / GB,
        "train_total_gb": (s.vocab * s.hidden * s.dtype_bytes + state + tokens * per_token) / GB,
        "features_bytes_per_token": 4 * s.hidden * storage_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a model directory or its config.json")
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per process and step (batch x length)")
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--num-layers", type=int, default=1, help="the drafter's decoder layers (drafter.num_layers)")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--sharding", choices=["none", "zero2", "zero3", "fsdp"], default="none")
    parser.add_argument("--storage-bytes", type=int, default=2, help="bytes per stored feature value (bf16: 2)")
    args = parser.parse_args(argv)
    try:
        file, config = read_config(args.config)
        s = shape_of(config, str(file))
    except MemoryError_ as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, value in (("--draft-vocab", args.draft_vocab), ("--tokens", args.tokens), ("--processes", args.processes),
                        ("--ttt-steps", args.ttt_steps), ("--num-layers", args.num_layers),
                        ("--storage-bytes", args.storage_bytes)):  # fmt: skip
        if value < 1:
            print(f"error: {name}: must be >= 1, got {value}", file=sys.stderr)
            return 2
    est = estimate(s, draft_vocab=args.draft_vocab, tokens=args.tokens, ttt_steps=args.ttt_steps,
                   num_layers=args.num_layers, processes=args.processes, sharding=args.sharding,
                   storage_bytes=args.storage_bytes)  # fmt: skip
    print(f"{file}: {target_params(s) / 1e9:.2f}B parameters, {s.layers} layers, hidden {s.hidden}, vocab {s.vocab}")
    print(
        f"  extraction / self-distillation / online training: {est['target_gb']:.1f} GB of target weights per process"
    )
    print(
        f"  EAGLE-3 training ({est['drafter_trainable_m']:.0f}M trainable, {args.processes} process(es), "
        f"{args.sharding}): {est['train_total_gb']:.1f} GB per process = embedding {est['train_embedding_gb']:.1f} + "
        f"weights, gradients and AdamW {est['train_state_gb']:.1f} + activations {est['train_activations_gb']:.1f} "
        f"({args.tokens} tokens x {args.ttt_steps} steps)"
    )
    print(f"  feature store: {est['features_bytes_per_token']:,} bytes per token ({args.storage_bytes}-byte values)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

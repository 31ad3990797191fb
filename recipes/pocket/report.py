"""Evaluate the exported pocket target and write its TRAINING.md and greedy reference.

    python recipes/pocket/report.py recipes/pocket/pretrain-stage2.yaml   # the last stage's config

Reads the bf16 model in `export_dir` (computing in fp32), measures the loss on the HELD-OUT split
(every token, windows of `seq_len`), greedily continues the first three held-out prompts, and
writes `export_dir/TRAINING.md` and `export_dir/greedy_reference.json` (the continuation that
tests/test_pocket.py checks the shipped weights against).
"""

import argparse
import json
import math
import platform
from pathlib import Path

import torch
from pretrain import PretrainConfig, mean_loss, token_stream
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = Path(__file__).parent / "prompts" / "heldout.jsonl"
N_SAMPLES, SAMPLE_TOKENS = 3, 64
REFERENCE_TOKENS = 32
STAGE_CONFIGS = ["recipes/pocket/pretrain.yaml", "recipes/pocket/pretrain-stage2.yaml"]  # in order


def stage_lines(stats: dict, cfg: PretrainConfig, train_tokens: int) -> list[str]:
    """The Training section's bullet list: one line per earlier stage (from `earlier_stages`), then this run."""
    lines = []
    stages = stats.get("earlier_stages", [])
    for i, stage in enumerate(stages, 1):
        lines.append(
            f"- stage {i}: {stage['step']} steps, {stage['tokens_seen'] / 1e6:.2f}M tokens, "
            f"{stage['train_seconds'] / 60:.1f} min of step time, final validation loss {stage['valid_loss']:.4f}"
        )
    this = f"stage {len(stages) + 1} (this config, from stage {len(stages)}'s checkpoint)" if stages else "training"
    lines += [
        f"- {this}: {stats['step']} / {stats['max_steps']} steps, peak lr {cfg.lr:g} after {cfg.warmup_steps} "
        f"warm-up steps, {stats['tokens_seen'] / 1e6:.2f}M tokens, {stats['train_seconds'] / 60:.1f} min of step time, "
        f"final validation loss {stats['valid_loss']:.4f} ({cfg.eval_batches} batches of the valid split)",
    ]
    tokens = stats["tokens_seen"] + sum(s["tokens_seen"] for s in stages)
    seconds = stats["train_seconds"] + sum(s["train_seconds"] for s in stages)
    lines.append(
        f"- in all: {tokens / 1e6:.2f}M tokens ({tokens / train_tokens:.2f} epochs), "
        f"{seconds / 60:.1f} min of step time"
    )
    return lines


@torch.no_grad()
def greedy(model, tok, prompt: str, max_new_tokens: int) -> list[int]:
    ids = torch.tensor([[tok.bos_token_id] + tok(prompt, add_special_tokens=False)["input_ids"]])  # (1, T)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens)
    return out[0, ids.shape[1] :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("--note", action="append", default=[], help="a line for the Training section (repeatable)")
    args = parser.parse_args()
    cfg = PretrainConfig.from_yaml(args.config)
    torch.set_num_threads(cfg.threads)
    export = Path(cfg.export_dir)
    stats = json.loads((export / "training_stats.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(export)

    train_tokens = len(token_stream(cfg, "train"))
    heldout = token_stream(cfg, "heldout")
    heldout_loss = mean_loss(model, heldout, cfg, max_batches=None)
    prompts = [json.loads(line) for line in PROMPTS.read_text().splitlines()[:N_SAMPLES]]
    samples = [(p, tok.decode(greedy(model, tok, p["prompt"], SAMPLE_TOKENS))) for p in prompts]

    reference_prompt = prompts[0]["prompt"]
    reference_ids = greedy(model, tok, reference_prompt, REFERENCE_TOKENS)
    reference = {
        "prompt": reference_prompt,
        "dtype": "float32",
        "max_new_tokens": REFERENCE_TOKENS,
        "token_ids": reference_ids,
        "text": tok.decode(reference_ids),
    }
    (export / "greedy_reference.json").write_text(json.dumps(reference, indent=2, ensure_ascii=False) + "\n")

    m = model.config
    stage_configs = [*STAGE_CONFIGS[: len(stats.get("earlier_stages", []))], str(args.config)]
    corpus = json.loads((Path(cfg.corpus) / "manifest.json").read_text())["splits"]
    finished = stats["step"] == stats["max_steps"]
    status = (
        ""
        if finished
        else f"\n**PARTIAL: exported from the step-{stats['step']} checkpoint of {stats['max_steps']}.**\n"
    )
    weights_mb = (export / "model.safetensors").stat().st_size / 1e6
    lines = [
        "# Pocket target: training record",
        status,
        f"Llama architecture, {stats['params'] / 1e6:.2f}M parameters ({weights_mb:.1f} MB bf16 safetensors): "
        f"{m.num_hidden_layers} layers, hidden {m.hidden_size}, MLP {m.intermediate_size}, "
        f"{m.num_attention_heads} heads / {m.num_key_value_heads} KV heads, "
        f"RoPE θ {m.rope_parameters['rope_theta']:g}, "
        f"vocab {m.vocab_size} (byte-level BPE), tied embeddings: {'yes' if m.tie_word_embeddings else 'no'}.",
        "",
        "## Data",
        "Python 3.11 standard library sources and the Python 3.11 documentation sources (Debian `python3.11-doc`, "
        "`_sources/*.rst.txt`), both PSF-licensed; split by file (hash of path) 96/2/2. "
        + ", ".join(f"{k}: {v['documents']} files, {v['bytes'] / 1e6:.1f} MB" for k, v in corpus.items())
        + f"; train split = {train_tokens / 1e6:.2f}M tokens.",
        "",
        "## Training",
        f"Random windows of {cfg.seq_len} tokens from the packed `<|bos|> doc <|eos|>` train stream, batch "
        f"{cfg.batch_size}; AdamW β={tuple(cfg.betas)}, weight decay {cfg.weight_decay}, linear warm-up then cosine "
        f"to {cfg.min_lr_ratio:g}× peak, grad clip {cfg.grad_clip}; bf16 autocast with fp32 master weights; 2 CPU "
        f"threads ({platform.processor() or platform.machine()}), shared with other jobs.",
        "",
        *stage_lines(stats, cfg, train_tokens),
        *(f"- {note}" for note in args.note),
        "",
        "## Results",
        f"- **held-out loss {heldout_loss:.4f} nats/token, perplexity {math.exp(heldout_loss):.2f}** "
        f"({len(heldout) - 1} held-out tokens, fp32 eval of the bf16 weights)",
        "",
        f"## Greedy continuations of held-out prompts ({SAMPLE_TOKENS} new tokens)",
    ]
    for prompt, text in samples:
        lines += ["", f"Prompt (`{prompt['id']}`):", "```", prompt["prompt"].rstrip("\n"), "```"]
        lines += ["Continuation:", "```", text, "```"]
    lines += [
        "",
        "## Reproduce",
        "```",
        "apt-get install -y python3.11-doc",
        "python recipes/pocket/corpus.py --out artifacts/pocket-corpus",
        "python recipes/pocket/tokenizer.py --corpus artifacts/pocket-corpus --out recipes/pocket/target",
        *(f"accelerate launch recipes/pocket/pretrain.py {c}   # --resume after a crash" for c in stage_configs),
        f"python recipes/pocket/report.py {args.config}",
        "```",
        "",
    ]
    (export / "TRAINING.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

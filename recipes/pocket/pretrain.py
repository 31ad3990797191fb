"""Pretrain the pocket target (a small Llama) on the pocket corpus, then export it.

    accelerate launch recipes/pocket/pretrain.py recipes/pocket/pretrain.yaml [--resume] [--export-only]

(plain `python recipes/pocket/pretrain.py ...` works too). Prepare the inputs first:

    python recipes/pocket/corpus.py --out artifacts/pocket-corpus
    python recipes/pocket/tokenizer.py --corpus artifacts/pocket-corpus --out recipes/pocket/target

Every document is `<|bos|> text <|eos|>`; a split's documents are concatenated into one token
stream and training samples are random windows of `seq_len + 1` tokens (drawn from a generator
seeded by `seed + step`, so a resumed run sees the same batches). AdamW, linear warm-up then
cosine decay, bf16 autocast. A checkpoint (`save_pretrained`, AdamW moments as safetensors, the run's state
and schedule as JSON: no pickle) is written every `save_every` steps; `--resume` continues from it, on the
config's schedule (a larger `max_steps` extends the run). At the end the model is exported in bf16 to
`export_dir` (next to the tokenizer) with `training_stats.json`.

The shipped target is trained in two stages: `pretrain.yaml`, then `pretrain-stage2.yaml`, whose
`init_from` starts from stage 1's checkpoint with a fresh optimizer and schedule (continued
pretraining); `training_stats.json` lists the earlier stages under `earlier_stages`.
"""

import argparse
import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

STAGE_STATS = ("step", "tokens_seen", "train_seconds", "valid_loss")  # a run's summary, in stats and earlier_stages


@dataclasses.dataclass
class PretrainConfig:
    corpus: str  # directory written by corpus.py ({train,valid,heldout}.jsonl)
    tokenizer: str  # directory written by tokenizer.py
    out_dir: str  # token caches, checkpoint, logs
    export_dir: str  # final bf16 model (next to the tokenizer)
    model: dict  # LlamaConfig fields
    seq_len: int = 512
    batch_size: int = 16
    max_steps: int = 1000
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    save_every: int = 50
    seed: int = 0
    threads: int = 2
    mixed_precision: str = "bf16"  # autocast; ~1.9x faster than fp32 on avx512_bf16 CPUs
    # Continued pretraining: start from this checkpoint's weights (a directory written by an earlier
    # run's `out_dir/checkpoint`) with a fresh optimizer and a new warm-up + cosine schedule.
    init_from: str | None = None
    compile: bool = False  # torch.compile the model (~1.2x on 2 CPU cores after ~1 min of compiling)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "PretrainConfig":
        raw = yaml.safe_load(Path(path).read_text())
        unknown = set(raw) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
        raw["betas"] = tuple(raw.get("betas", cls.betas))
        return cls(**raw)


def token_stream(cfg: PretrainConfig, split: str) -> torch.Tensor:
    """All documents of a split as one int64 stream `<|bos|> doc <|eos|> <|bos|> doc ...`, cached."""
    cache = Path(cfg.out_dir) / f"tokens-{split}.safetensors"
    if cache.exists():
        return load_file(str(cache))["tokens"].long()
    tok = AutoTokenizer.from_pretrained(cfg.tokenizer)
    with open(Path(cfg.corpus) / f"{split}.jsonl", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    ids: list[int] = []
    for encoded in tok(texts, add_special_tokens=True, verbose=False)["input_ids"]:  # adds <|bos|>
        ids += encoded + [tok.eos_token_id]
    stream = torch.tensor(ids, dtype=torch.int16 if len(tok) < 2**15 else torch.int32)
    cache.parent.mkdir(parents=True, exist_ok=True)
    save_file({"tokens": stream}, str(cache))
    return stream.long()


def train_batch(stream: torch.Tensor, cfg: PretrainConfig, step: int, rank: int = 0) -> torch.Tensor:
    """(B, T+1) random windows of the stream, seeded by (seed, step, process rank): a resumed run sees the same
    batches, and every process of a multi-process run sees its own (rank 0 draws what a single process draws)."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step + rank * 1_000_000_000_039)
    starts = torch.randint(0, len(stream) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
    return torch.stack([stream[s : s + cfg.seq_len + 1] for s in starts.tolist()])  # (B, T+1)


def next_token_loss(model: LlamaForCausalLM, x: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x[:, :-1]).logits  # (B, T, V)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())


@torch.no_grad()
def mean_loss(model: LlamaForCausalLM, stream: torch.Tensor, cfg: PretrainConfig, max_batches: int | None) -> float:
    """Token-weighted loss over consecutive non-overlapping windows of the stream."""
    model.eval()
    windows = stream[: (len(stream) - 1) // cfg.seq_len * cfg.seq_len + 1]
    starts = list(range(0, len(windows) - 1, cfg.seq_len))
    batches = [starts[i : i + cfg.batch_size] for i in range(0, len(starts), cfg.batch_size)][:max_batches]
    total, count = 0.0, 0
    for batch_starts in batches:
        x = torch.stack([windows[s : s + cfg.seq_len + 1] for s in batch_starts])  # (B, T+1)
        total += next_token_loss(model, x).item() * x[:, 1:].numel()
        count += x[:, 1:].numel()
    model.train()
    return float(total / count)


def lr_lambda(cfg: PretrainConfig):
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_model(cfg: PretrainConfig) -> LlamaForCausalLM:
    tok = AutoTokenizer.from_pretrained(cfg.tokenizer)
    config = LlamaConfig(
        **cfg.model, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    assert config.vocab_size == len(tok), (config.vocab_size, len(tok))
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(config)


def check_architecture(config: LlamaConfig, cfg: PretrainConfig, where: Path) -> None:
    """`init_from` must hold the architecture this config describes: a stage never silently trains another model."""
    for key, value in cfg.model.items():
        have = config.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(config, key, None)
        if have != value:
            raise SystemExit(f"{where}: model.{key} is {value!r} but init_from {cfg.init_from} has {have!r}")


def save_checkpoint(path: Path, model, optimizer, scheduler, state: dict) -> None:
    """Weights (safetensors), AdamW moments (optimizer.safetensors, keyed "<param index>/<key>"), and the run's
    state, parameter groups and schedule (state.json): never a pickle. Written to a temporary directory and
    renamed, so a crash mid-save keeps the previous one."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    optim = optimizer.state_dict()
    moments = {f"{i}/{key}": value for i, s in optim["state"].items() for key, value in s.items()}
    save_file({k: v.contiguous() for k, v in moments.items()}, str(tmp / "optimizer.safetensors"))
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in optim["param_groups"]]
    full = {**state, "param_groups": groups, "scheduler": scheduler.state_dict()}
    (tmp / "state.json").write_text(json.dumps(full, indent=1))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def load_state(checkpoint: Path) -> dict:
    """state.json of a checkpoint (see `save_checkpoint`)."""
    return json.loads((checkpoint / "state.json").read_text())


def load_optimizer(checkpoint: Path, optimizer, saved: dict) -> None:
    """AdamW moments and parameter groups back into a freshly built optimizer."""
    state: dict[int, dict] = {}
    for key, value in load_file(str(checkpoint / "optimizer.safetensors")).items():
        index, name = key.split("/", 1)
        state.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def export(cfg: PretrainConfig, checkpoint: Path) -> None:
    """The checkpoint's weights in bf16 + generation config + training stats -> export_dir."""
    model = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    state = load_state(checkpoint)
    tok = AutoTokenizer.from_pretrained(cfg.tokenizer)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")],
        pad_token_id=tok.pad_token_id,
        do_sample=False,
    )
    model.to(torch.bfloat16).save_pretrained(cfg.export_dir, safe_serialization=True)
    stats = {k: state[k] for k in STAGE_STATS}
    stats["earlier_stages"] = state.get("earlier_stages", [])
    stats |= {"max_steps": cfg.max_steps, "params": sum(p.numel() for p in model.parameters())}
    stats["config"] = dataclasses.asdict(cfg)
    (Path(cfg.export_dir) / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(f"exported step {state['step']}/{cfg.max_steps} -> {cfg.export_dir}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("--resume", action="store_true", help="continue from out_dir/checkpoint")
    parser.add_argument("--export-only", action="store_true", help="export out_dir/checkpoint and stop")
    args = parser.parse_args()
    cfg = PretrainConfig.from_yaml(args.config)
    torch.set_num_threads(cfg.threads)
    checkpoint = Path(cfg.out_dir) / "checkpoint"
    if args.export_only:
        return export(cfg, checkpoint)

    # the scheduler counts optimizer steps; by default accelerate would step it once per process per step
    accelerator = Accelerator(mixed_precision=cfg.mixed_precision, step_scheduler_with_optimizer=False)
    train_stream, valid_stream = token_stream(cfg, "train"), token_stream(cfg, "valid")
    state = {"step": 0, "tokens_seen": 0, "train_seconds": 0.0, "valid_loss": None, "earlier_stages": []}
    if args.resume:
        model = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    elif cfg.init_from:
        model = LlamaForCausalLM.from_pretrained(cfg.init_from, dtype=torch.float32)
        check_architecture(model.config, cfg, args.config)
        earlier = load_state(Path(cfg.init_from))
        stage = {k: earlier[k] for k in STAGE_STATS}
        state["earlier_stages"] = earlier.get("earlier_stages", []) + [stage | {"checkpoint": cfg.init_from}]
    else:
        model = build_model(cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=cfg.betas,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    if args.resume:
        saved = load_state(checkpoint)
        load_optimizer(checkpoint, optimizer, saved)
        scheduler.load_state_dict(saved.pop("scheduler"))
        saved.pop("param_groups")
        for group, base in zip(optimizer.param_groups, scheduler.base_lrs):  # this config's schedule (max_steps)
            group["lr"] = base * lr_lambda(cfg)(scheduler.last_epoch)
        state = saved
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    raw_model = accelerator.unwrap_model(model)
    if cfg.compile:
        model = torch.compile(model)
    n_params = sum(p.numel() for p in model.parameters())
    accelerator.print(
        f"params {n_params / 1e6:.2f}M, train tokens {len(train_stream) / 1e6:.2f}M, from step {state['step']}"
    )

    bar = tqdm(range(state["step"], cfg.max_steps), initial=state["step"], total=cfg.max_steps, mininterval=10)
    for step in bar:
        t0 = time.perf_counter()
        x = train_batch(train_stream, cfg, step, accelerator.process_index).to(accelerator.device)  # (B, T+1)
        loss = next_token_loss(model, x)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        state["step"] = step + 1
        state["tokens_seen"] += x[:, :-1].numel() * accelerator.num_processes
        state["train_seconds"] += seconds
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{x[:, :-1].numel() / seconds:.0f}", refresh=False)
        if state["step"] % cfg.eval_every == 0 or state["step"] == cfg.max_steps:
            state["valid_loss"] = mean_loss(model, valid_stream, cfg, cfg.eval_batches)
            accelerator.print(
                f"step {state['step']} train/loss {loss.item():.4f} valid/loss {state['valid_loss']:.4f} "
                f"lr {scheduler.get_last_lr()[0]:.2e} tokens {state['tokens_seen']} time {state['train_seconds']:.0f}s",
                flush=True,
            )
        if state["step"] % cfg.save_every == 0 or state["step"] == cfg.max_steps:
            if accelerator.is_main_process:
                save_checkpoint(checkpoint, raw_model, optimizer, scheduler, state)
    if accelerator.is_main_process:
        export(cfg, checkpoint)


if __name__ == "__main__":
    main()

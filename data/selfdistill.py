"""Self-distillation: let the target write the responses a drafter is then trained on.

    python -m data.selfdistill --target PATH --prompts FILE.jsonl --out OUT.jsonl \
        [--max-new-tokens 256 --temperature 0 --top-p 1 --seed 0 --batch-size 8 --limit N]
    accelerate launch --num_processes N -m data.selfdistill ...   (same arguments, prompts split by batch)
    python -m data.selfdistill ... --engine vllm [--engine-python .venv-vllm/bin/python] [--engine-args JSON] \
        [--engine-window 256]                                       (vLLM's LLM.generate, in a worker process)

Reads prompt records, one JSON object a line, in either format that `data.prepare` reads:
  * plain `{"id"?, "prompt": str}` -> `{"id", "prompt", "completion", "completion_ids", "generation"}`; the
    input is `bos + prompt` exactly as data.prepare tokenizes it, and `completion_ids` are the generated token ids
    (the stop token last when generation stopped), which data.prepare trains on instead of re-encoding the text
    (decoding then encoding does not always give the same tokens back);
  * chat `{"messages": [...]}` (OpenAI) or `{"conversations": [...]}` (ShareGPT) -> the same record
    with every assistant turn written by the target (turn by turn, through the tokenizer's chat
    template with the generation prompt, after the already regenerated earlier turns), plus
    `assistant_ids`: the generated token ids of each assistant turn (stop token last when it stopped), which
    data.prepare splices into the rendered conversation instead of re-encoding the text; the input of a later
    turn holds the earlier turns' ids in the same way. A user turn with no assistant reply after it
    (prompts-only chats) gets one inserted.
A record's id is its `id` field, else `line<N>`. Decoding is greedy when --temperature is 0, else
sampled with temperature / top-p from a generator seeded by (--seed, id, turn). Generation stops at the
target's EOS tokens (generation config and tokenizer) and `<|end|>` when the vocabulary has it; the stop
token is not part of the text. Every record carries `"generation"` (settings, per-turn seeds,
finish reasons "stop" / "length"); OUT.jsonl.meta.json holds the settings and the target's identity.

Several processes (`accelerate launch -m data.selfdistill ...`): the prompts are cut into batches of
--batch-size in file order and batch k goes to process k mod N; each process appends to OUT.part<rank>
and the main process merges the parts into OUT in prompt order at the end. Batches never depend on the
number of processes or on resuming, so OUT holds the same records for 1 or N processes (a batch's
left padding changes a row's bf16 numerics, so the batch size is part of the settings).

Engines: `--engine hf` (the default) runs transformers' `generate` in this process. `--engine vllm` runs vLLM's
offline `LLM.generate` in a worker process of the Python that has vLLM (`--engine-python`, by default .venv-vllm's,
which `make vllm-env` builds; data/engines.py): it gets the token ids the HF engine would (`prompt_token_ids`), the
records keep the ids vLLM generated, and all the rest (rendering, seeds, stop tokens, finish reasons, part files,
resuming) is this module's, the same for both. Each process has its own engine (`accelerate launch`: data parallel;
on GPUs each engine gets its own, see `engine_devices`); `--engine-args` are `vllm.LLM` arguments (e.g.
`tensor_parallel_size`). `--engine-window` prompt records (whole batches) go to vLLM in one call, which it schedules
itself, and are written when it returns: a crash loses at most one window. Greedy records equal the HF engine's
where both compute the same argmax (a float32 target far from ties: `make check-vllm-selfdistill`; bf16 near-ties can
go either way, as between batch sizes); sampled records draw from vLLM's per-request generator seeded with the
record's seed (`SamplingParams(seed=...)`), not the HF engine's draws. The engine is one of the recorded settings (a
meta file without it is an HF run); records name it in their `generation` only when it is not "hf".

Re-running with the same OUT resumes: parts left by an interrupted run are merged first (a truncated
last line is dropped), batches whose records are all done are skipped; a larger --limit extends OUT
with the next prompts, giving the records one run with that limit gives. Resuming onto other prompts (the file
compared by content, not by name), other settings or another target (its config and tokenizer files, and samples
of its weight files' bytes) is refused.

Beside it: `data/generation.py` (the settings and the two generators) and `data/selfdistill_parts.py` (what binds
an output, the records done, the part files and their merge).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
)

from data.chat import SHAREGPT_ROLES, ChatTemplateError, DataError, render_with_turn_ids
from data.engines import (
    RESERVED_ENGINE_ARGS,
    EngineError,
    VllmEngine,
    add_engine_options,
    engine_env,
    engine_options,
    engine_python,
    vllm_dtype,
)
from data.generation import (
    GenerationSettings,
    Generator,
    SelfDistillError,
    VllmGenerator,
    record_settings,
    stop_token_ids,
    target_eos,
)
from data.prepare import vocab_fingerprint
from data.selfdistill_parts import (
    check_new_tokens,
    merge_parts,
    part_files,
    part_path,
    read_done,
    run_difference,
    target_identity,
)
from models.target import process_memory
from rundir.lock import lock_for_all


def read_prompts(path: Path, limit: int | None) -> list[tuple[str, dict[str, Any]]]:
    """(id, record) for every record, validated; errors name the file and line."""
    records, seen = [], set()
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if limit is not None and len(records) == limit:
                break
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise SelfDistillError(
                    f"{where}: not UTF-8 text (byte {raw[exc.start]:#04x} at column {exc.start + 1})"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SelfDistillError(f"{where}: invalid JSON ({exc})") from None
            if not isinstance(record, dict):
                raise SelfDistillError(f"{where}: expected a JSON object, got {type(record).__name__}")
            try:
                check_record(record)
            except SelfDistillError as exc:
                raise SelfDistillError(f"{where}: {exc}") from None
            rid = str(record["id"]) if "id" in record else f"line{line_no}"
            if rid in seen:
                raise SelfDistillError(f"{where}: duplicate id {rid!r}")
            seen.add(rid)
            records.append((rid, record))
    return records


def first_line(exc: BaseException) -> str:
    """The first line of a loader's error (transformers' run over several lines)."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def check_record(record: dict[str, Any]) -> None:
    if "conversations" in record or "messages" in record:
        key, role_key, text_key = chat_keys(record)
        turns = record[key]
        if not isinstance(turns, list) or not turns:
            raise SelfDistillError(f"`{key}` must be a non-empty list of turns")
        for j, turn in enumerate(turns):
            if not isinstance(turn, dict) or not isinstance(turn.get(text_key), str) or role_key not in turn:
                raise SelfDistillError(f"{key}[{j}]: needs `{role_key}` and a string `{text_key}`")
            if not isinstance(turn[role_key], str):
                raise SelfDistillError(f"{key}[{j}]: `{role_key}` must be a string, got {turn[role_key]!r}")
            if key == "conversations" and turn[role_key] not in SHAREGPT_ROLES:
                raise SelfDistillError(f"{key}[{j}]: unknown role {turn[role_key]!r}")
            if key == "messages" and turn[role_key] not in ("system", "user", "assistant"):
                raise SelfDistillError(f"{key}[{j}]: unknown role {turn[role_key]!r}")
    elif not isinstance(record.get("prompt"), str):
        raise SelfDistillError("expected a string `prompt`, or `messages` / `conversations`")


def chat_keys(record: dict[str, Any]) -> tuple[str, str, str]:
    """(list key, role key, text key) of a chat record."""
    return ("conversations", "from", "value") if "conversations" in record else ("messages", "role", "content")


def record_seed(seed: int, rid: str, turn: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}\0{rid}\0{turn}".encode()).digest()[:8], "big") >> 1


def is_chat(record: dict[str, Any]) -> bool:
    return "conversations" in record or "messages" in record


def chat_turns(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Copies of the record's turns; assistant turns (existing, or inserted after an unanswered
    user turn) have their text set to None, to be written by the target."""
    key, role_key, text_key = chat_keys(record)
    assistant = "gpt" if key == "conversations" else "assistant"
    turns: list[dict[str, Any]] = []
    for j, turn in enumerate(record[key]):
        is_assistant = role_of(record, turn) == "assistant"
        turns.append(dict(turn, **{text_key: None}) if is_assistant else dict(turn))
        following = record[key][j + 1] if j + 1 < len(record[key]) else None
        if role_of(record, turn) == "user" and (following is None or role_of(record, following) != "assistant"):
            turns.append({role_key: assistant, text_key: None})
    return turns


def role_of(record: dict[str, Any], turn: dict[str, Any]) -> str:
    return SHAREGPT_ROLES[turn["from"]] if "conversations" in record else turn["role"]


def distill_batch(batch: list[tuple[str, dict[str, Any]]], generate: Generator) -> list[dict[str, Any]]:
    """Output records for a batch of (id, record): plain prompts in one call, chats turn by turn."""
    tok, settings = generate.tokenizer, generate.settings
    vocab = vocab_fingerprint(tok)  # what the ids mean: data.prepare refuses them with another vocabulary
    outputs = [dict(record, id=record.get("id", rid)) for rid, record in batch]
    for out in outputs:
        out["generation"] = record_settings(settings) | {"vocab": vocab, "record_seeds": [], "finish_reason": []}
        if is_chat(out):
            out[chat_keys(out)[0]] = chat_turns(out)
            out["assistant_ids"] = []

    plain = [i for i, out in enumerate(outputs) if not is_chat(out)]
    if plain:
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        inputs = [bos + tok(outputs[i]["prompt"], add_special_tokens=False)["input_ids"] for i in plain]
        seeds = [record_seed(settings.seed, batch[i][0], 0) for i in plain]
        for i, seed, (text, reason, ids) in zip(plain, seeds, generate(inputs, seeds)):
            outputs[i]["completion"] = text
            outputs[i]["completion_ids"] = ids
            outputs[i]["generation"] |= {"record_seeds": [seed], "finish_reason": [reason]}

    # Chats: round r writes the r-th assistant turn of every conversation that has one.
    for r in itertools.count():
        slots = []  # (output index, turn index) of the next unwritten assistant turn
        for i, out in enumerate(outputs):
            if is_chat(out):
                key, _, text_key = chat_keys(out)
                nxt = next((j for j, t in enumerate(out[key]) if t[text_key] is None), None)
                if nxt is not None:
                    slots.append((i, nxt))
        if not slots:
            break
        inputs, seeds = [], []
        for i, j in slots:
            key, _, text_key = chat_keys(outputs[i])
            messages = [{"role": role_of(outputs[i], t), "content": t[text_key]} for t in outputs[i][key][:j]]
            # The earlier turns as the target wrote them (its token ids), the template's text around them.
            written = outputs[i]["assistant_ids"]
            cut = frozenset(k for k, r in enumerate(outputs[i]["generation"]["finish_reason"]) if r == "length")
            try:
                ids, _ = render_with_turn_ids(messages, tok, written, cut, generation_prompt=True)
            except (DataError, ChatTemplateError) as exc:  # e.g. a template that refuses this order of roles
                raise SelfDistillError(f"record {batch[i][0]!r}, assistant turn {r + 1}: {exc}") from None
            inputs.append(ids)
            seeds.append(record_seed(settings.seed, batch[i][0], r))
        for (i, j), seed, (text, reason, ids) in zip(slots, seeds, generate(inputs, seeds)):
            key, _, text_key = chat_keys(outputs[i])
            outputs[i][key][j][text_key] = text
            outputs[i]["assistant_ids"].append(ids)
            outputs[i]["generation"]["record_seeds"].append(seed)
            outputs[i]["generation"]["finish_reason"].append(reason)
    for out in outputs:
        if "assistant_ids" in out:
            out["assistant_ids"] = out.pop("assistant_ids")
        out["generation"] = out.pop("generation")  # last, so records read prompt -> completion -> settings
    return outputs


def start_vllm(args: argparse.Namespace, engine_args: dict[str, Any], state) -> VllmEngine:
    """This process's vLLM worker, on its own accelerators when several processes share a node's."""
    python = engine_python(args.engine_python)
    log = args.out.with_name(f"{args.out.name}.vllm{state.process_index}.log")
    print(f"vLLM engine: {python} loads {args.target} (its log: {log})", file=sys.stderr)
    try:
        env = engine_env(engine_args, state, torch.cuda.device_count() if torch.cuda.is_available() else 0)
        return VllmEngine(
            python,
            args.target,
            vllm_dtype(args.target, args.dtype),
            log,
            trust_remote_code=args.trust_remote_code,
            engine_args=engine_args,
            env=env,
        )
    except EngineError as exc:
        raise SelfDistillError(f"--engine vllm: {exc}") from None


def device_map_arg(text: str) -> str | dict:
    """--device-map: a strategy name, or a JSON object of module names to devices."""
    if not text.lstrip().startswith("{"):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not a JSON object ({exc})") from None


def prompts_sha256(records: list[tuple[str, dict[str, Any]]]) -> str:
    """What the prompts say, not what their file is called: a resumed run must continue the same prompts."""
    blob = json.dumps([[rid, record] for rid, record in records], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="HF causal LM directory (model + tokenizer)")
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--limit", type=int, default=None, help="only the first N prompt records")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=None, help="--engine hf: default this process's accelerator, else cpu")
    parser.add_argument(
        "--device-map",
        type=device_map_arg,
        default=None,
        help="--engine hf: spread the target over this process's share of the node's GPUs (auto, balanced, "
        'sequential), or place it as a JSON map says, e.g. {"model.layers.20": 1, "lm_head": "cpu"}',
    )
    parser.add_argument("--offload-folder", default=None, help='--device-map: where its "disk" entries keep weights')
    parser.add_argument("--trust-remote-code", action="store_true")
    add_engine_options(parser, "transformers' generate, or vLLM's LLM.generate", '{"max_num_seqs": 64}')
    parser.add_argument(
        "--engine-window",
        type=int,
        default=256,
        help="--engine vllm: prompt records per LLM.generate call (whole batches; vLLM batches them itself). "
        "A crash loses at most the window being generated",
    )
    args = parser.parse_args(argv)
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.max_new_tokens < 1 or args.batch_size < 1:
        parser.error("need --temperature >= 0, 0 < --top-p <= 1, --max-new-tokens >= 1, --batch-size >= 1")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be >= 1")
    if args.engine_window < 1:
        parser.error("--engine-window must be >= 1")
    engine_args = engine_options(parser, args)
    for flag, value in (("--device", args.device), ("--device-map", args.device_map)):
        if args.engine == "vllm" and value is not None:
            parser.error(f"{flag} is for --engine hf: vLLM places the model itself (see --engine-args)")
    if args.device is not None and args.device_map is not None:
        parser.error("--device and --device-map exclude each other")
    reserved = sorted(RESERVED_ENGINE_ARGS & set(engine_args))
    if reserved:
        raise SelfDistillError(f"--engine-args may not set {', '.join(reserved)} (the target and the settings do)")
    if not args.prompts.is_file():
        raise SelfDistillError(f"{args.prompts}: no such prompts file")
    if args.out.is_dir():
        raise SelfDistillError(f"{args.out}: is a directory; --out names the JSONL file to write")
    if not Path(args.target).is_dir():
        raise SelfDistillError(f"{args.target}: no such target directory (--target is a local model directory)")
    if not (Path(args.target) / "config.json").is_file():
        raise SelfDistillError(f"{args.target}: not a Hugging Face model directory (no config.json)")
    check_new_tokens(args.target, args.max_new_tokens, SelfDistillError)

    from accelerate import PartialState
    from accelerate.utils import gather_object, parse_flag_from_env

    # one process without `accelerate launch`; several CPU processes talk gloo (`--multi_gpu` with ACCELERATE_USE_CPU)
    # With --engine vllm the processes only deal out batches (gloo): the engines hold the accelerators.
    cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available() or args.engine != "hf"
    state = PartialState(cpu=cpu)
    # one writer per output: a second self-distillation into the same --out stops on every process with one line
    with lock_for_all(
        args.out, "self-distillation", "--out", state.is_main_process, gather_object, True, SelfDistillError
    ):
        distill(args, engine_args, state)


def distill(args: argparse.Namespace, engine_args: dict, state) -> None:
    """Generate the missing answers (this process's batches) into its part file, then merge the parts into --out."""
    every = read_prompts(args.prompts, None)
    records = every[: args.limit]
    if not records:
        raise SelfDistillError(f"{args.prompts}: no prompt records")
    settings = GenerationSettings(
        prompts=prompts_sha256(every),
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p if args.temperature > 0 else 1.0,
        seed=args.seed,
        dtype=args.dtype,
        batch_size=args.batch_size,
        engine=args.engine,
    )
    meta = {"settings": asdict(settings), "target": target_identity(args.target)}
    meta_path = args.out.with_name(args.out.name + ".meta.json")
    if state.is_main_process:
        if args.out.exists() or part_files(args.out):
            try:
                previous = json.loads(meta_path.read_text()) if meta_path.exists() else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                previous = None  # unreadable: treated as other settings
            if isinstance(previous, dict) and isinstance(previous.get("settings"), dict):
                previous["settings"].setdefault("engine", "hf")  # written before there was a choice of engine
            why = run_difference(previous, meta)
            if why is not None:
                raise SelfDistillError(
                    f"{args.out} holds records made with {why} (see {meta_path}); refusing to resume: delete it "
                    "(and its .part files) to start over, or write to another --out"
                )
            merge_parts(args.out, every)  # parts left by an interrupted run join OUT before anything is skipped
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    state.wait_for_everyone()
    done = read_done(args.out) if args.out.exists() else set()

    # Batches are cut from the whole prompt list, so each record's batch (its padding, hence its bf16 numerics)
    # is the same whatever the number of processes, however often the run was resumed and whatever --limit was
    # then (the last batch is generated whole and its records past the limit are not written). Batch k goes to
    # process k mod world_size.
    wanted = {rid for rid, _ in records}
    batches = [every[k : k + args.batch_size] for k in range(0, len(records), args.batch_size)]
    mine = [b for k, b in enumerate(batches) if k % state.num_processes == state.process_index]
    todo = [b for b in mine if any(rid in wanted and rid not in done for rid, _ in b)]
    remaining = sum(1 for rid, _ in records if rid not in done)
    if remaining and todo:
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.target, trust_remote_code=args.trust_remote_code)
        except (OSError, ValueError) as exc:
            raise SelfDistillError(f"{args.target}: no tokenizer could be loaded ({first_line(exc)})") from None
        if any(is_chat(rec) for b in todo for _, rec in b) and not tokenizer.chat_template:
            raise SelfDistillError(f"{args.prompts} has chat records but the target's tokenizer has no chat_template")
        engine = None
        if args.engine == "hf":
            dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
            placement = {}
            if args.device_map is not None:  # spread over this process's GPUs, or as the explicit map says
                placement = {"device_map": args.device_map, "offload_folder": args.offload_folder,
                             "max_memory": process_memory(args.device_map, state)}  # fmt: skip
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    args.target, dtype=dtype, trust_remote_code=args.trust_remote_code, **placement
                )
            except (OSError, ValueError, SafetensorError) as exc:  # e.g. truncated weights
                raise SelfDistillError(f"{args.target}: the model cannot be loaded ({first_line(exc)})") from None
            if args.device_map is None:
                model.to(args.device or state.device)
            model.eval()
            generate = Generator(model, tokenizer, settings)
            windows = [[b] for b in todo]  # one batch per `generate`: its padding is part of the output
        else:
            stop_ids = stop_token_ids(target_eos(args.target, args.trust_remote_code), tokenizer)
            engine = start_vllm(args, engine_args, state)
            generate = VllmGenerator(engine, tokenizer, settings, stop_ids)
            per = max(1, args.engine_window // args.batch_size)
            windows = [todo[k : k + per] for k in range(0, len(todo), per)]
        part = part_path(args.out, state.process_index)
        desc = (
            f"self-distill [{state.process_index}/{state.num_processes}]" if state.num_processes > 1 else "self-distill"
        )
        total = sum(len(b) for b in todo)
        try:
            with open(part, "a", encoding="utf-8") as f, tqdm(total=total, desc=desc, unit="rec") as bar:
                for window in windows:
                    for out in distill_batch([item for batch in window for item in batch], generate):
                        if str(out["id"]) in wanted and str(out["id"]) not in done:
                            f.write(json.dumps(out, ensure_ascii=False) + "\n")
                    f.flush()  # whole batches at a time: a crash loses at most the window being written
                    os.fsync(f.fileno())
                    bar.update(sum(map(len, window)))
        except EngineError as exc:
            raise SelfDistillError(f"--engine vllm: {exc}") from None
        finally:
            if engine is not None:
                engine.close()
    state.wait_for_everyone()
    if state.is_main_process:
        n = merge_parts(args.out, every)
        print(f"{args.out}: {n} records ({remaining} new)")


if __name__ == "__main__":
    try:
        main()
    except SelfDistillError as exc:
        sys.exit(f"error: {exc}")

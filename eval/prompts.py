"""Eval prompts: JSONL records rendered to token ids the way the target is prompted, and where decoding stops.

    prompts = load_prompts("recipes/pocket/prompts/heldout.jsonl", tokenizer, limit=20)  # [{index, id, input_ids}]
    settings = DecodeSettings(max_new_tokens=128, eos_token_ids=stop_token_ids(target))

Chat records (`messages`, or ShareGPT `conversations`) are rendered with the chat template up to their first
assistant turn plus the generation prompt; plain `prompt` records are tokenized as they are, after the BOS token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from data.chat import SHAREGPT_ROLES, DataError
from data.prepare import read_jsonl
from eval import EvalError
from models.target import Target

END_OF_TURN = "<|end|>"


def prompt_token_ids(record: dict[str, Any], tokenizer, where: str) -> list[int]:
    """A chat record (up to its first assistant turn, plus the generation prompt) or a plain `prompt` -> ids."""
    if not isinstance(record, dict):
        raise EvalError(f"{where}: a prompt record must be a JSON object, got {type(record).__name__}")
    turns = record.get("messages") or record.get("conversations")
    if turns is not None:
        if not isinstance(turns, list):
            raise EvalError(f"{where}: `messages` / `conversations` must be a list of turns")
        messages = []
        for turn in turns:
            if not isinstance(turn, dict):
                raise EvalError(f"{where}: a turn must be a JSON object, got {turn!r:.80}")
            role = SHAREGPT_ROLES.get(turn.get("role", turn.get("from")))
            if role is None:
                raise EvalError(f"{where}: unknown role in turn {turn!r:.80}")
            if role == "assistant":
                break
            messages.append({"role": role, "content": turn.get("content", turn.get("value"))})
        if not messages:
            raise EvalError(f"{where}: no user turn before the first assistant turn")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if isinstance(record.get("prompt"), str):
        ids = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
        bos = tokenizer.bos_token_id
        return ([bos] if bos is not None and ids[:1] != [bos] else []) + ids
    raise EvalError(f"{where}: needs `messages`, `conversations` or a string `prompt`")


def load_prompts(path: str, tokenizer, limit: int | None) -> list[dict[str, Any]]:
    """[{index, id, input_ids}] from a JSONL file; errors name file:line."""
    if not Path(path).is_file():
        raise EvalError(f"eval.prompts: no such file {path}")
    prompts = []
    for where, record in read_jsonl(path):
        if limit is not None and len(prompts) >= limit:
            break
        if isinstance(record, DataError):  # a line that is not JSON
            raise EvalError(str(record))
        ids = prompt_token_ids(record, tokenizer, where)
        group = record.get("category", record.get("kind"))  # MT-bench's categories, the SmolLM2 sets' kinds
        prompts.append({"index": len(prompts), "id": str(record.get("id", where)), "input_ids": ids, "group": group})
    if not prompts:
        raise EvalError(f"{path}: no prompts")
    return prompts


def stop_token_ids(target: Target) -> list[int]:
    """Where decoding stops: the target's EOS tokens, the tokenizer's, and `<|end|>` where the vocabulary has it
    (chat turns end there, as in data.selfdistill)."""
    eos = target.model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    stops = [target.tokenizer.eos_token_id]
    if END_OF_TURN in target.tokenizer.get_vocab():
        stops.append(target.tokenizer.convert_tokens_to_ids(END_OF_TURN))
    return eos + [t for t in stops if t is not None and t not in eos]

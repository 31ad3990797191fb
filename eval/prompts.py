"""Eval prompts: JSONL records rendered to token ids the way the target is prompted, and where decoding stops.

    prompts = load_prompts("recipes/pocket/prompts/heldout.jsonl", tokenizer, limit=20)  # [{index, id, input_ids}]
    settings = DecodeSettings(max_new_tokens=128, eos_token_ids=stop_token_ids(target))

Chat records (`messages`, or ShareGPT `conversations`) are rendered with the chat template up to their first
assistant turn plus the generation prompt; plain `prompt` records are tokenized as they are, after the BOS token.

Long context (`eval.context_lengths`): each chat prompt is also decoded behind earlier conversation, read from
`eval.context_source` (chat records with assistant turns, or plain prompt / completion records), so that its input
reaches up to each length:

    convs = load_conversations("artifacts/smollm2-run/context-conversations.jsonl")
    prompts = load_prompts(path, tokenizer, limit=20, context_lengths=[0, 1024, 4096], conversations=convs)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from data.chat import SHAREGPT_ROLES, DataError
from data.prepare import read_jsonl
from eval import EvalError
from models.target import Target

END_OF_TURN = "<|end|>"


Messages = list[dict[str, str]]


def chat_turns(record: dict[str, Any], where: str, until_assistant: bool) -> Messages | None:
    """A chat record's turns as {role, content} (roles normalised), up to its first assistant turn when
    `until_assistant`; None for a record that is not a chat."""
    turns = record.get("messages") or record.get("conversations")
    if turns is None:
        return None
    if not isinstance(turns, list):
        raise EvalError(f"{where}: `messages` / `conversations` must be a list of turns")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise EvalError(f"{where}: a turn must be a JSON object, got {turn!r:.80}")
        role = SHAREGPT_ROLES.get(turn.get("role", turn.get("from")))
        if role is None:
            raise EvalError(f"{where}: unknown role in turn {turn!r:.80}")
        if role == "assistant" and until_assistant:
            break
        content = turn.get("content", turn.get("value"))
        if not isinstance(content, str):
            raise EvalError(f"{where}: a turn's content must be a string, got {content!r:.80}")
        messages.append({"role": role, "content": content})
    return messages


def render(messages: Messages, tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_token_ids(record: dict[str, Any], tokenizer, where: str) -> list[int]:
    """A chat record (up to its first assistant turn, plus the generation prompt) or a plain `prompt` -> ids."""
    if not isinstance(record, dict):
        raise EvalError(f"{where}: a prompt record must be a JSON object, got {type(record).__name__}")
    messages = chat_turns(record, where, until_assistant=True)
    if messages is not None:
        if not messages:
            raise EvalError(f"{where}: no user turn before the first assistant turn")
        return render(messages, tokenizer)
    if isinstance(record.get("prompt"), str):
        ids = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
        bos = tokenizer.bos_token_id
        return ([bos] if bos is not None and ids[:1] != [bos] else []) + ids
    raise EvalError(f"{where}: needs `messages`, `conversations` or a string `prompt`")


def load_conversations(path: str) -> list[Messages]:
    """The conversations of `eval.context_source`: chat records' user and assistant turns (system turns dropped, a
    conversation ends with its last assistant turn), or {prompt, completion} records as one exchange; errors name
    file:line. Records without an answered user turn are skipped."""
    if not Path(path).is_file():
        raise EvalError(f"eval.context_source: no such file {path}")
    conversations = []
    for where, record in read_jsonl(path):
        if isinstance(record, DataError):
            raise EvalError(str(record))
        if not isinstance(record, dict):
            raise EvalError(f"{where}: a conversation record must be a JSON object, got {type(record).__name__}")
        turns = chat_turns(record, where, until_assistant=False)
        if turns is None:
            if not isinstance(record.get("prompt"), str) or not isinstance(record.get("completion"), str):
                raise EvalError(f"{where}: needs `messages`, `conversations`, or string `prompt` and `completion`")
            turns = [
                {"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["completion"]},
            ]
        turns = [t for t in turns if t["role"] != "system"]
        last = max((i for i, t in enumerate(turns) if t["role"] == "assistant"), default=None)
        if last is not None and turns[0]["role"] == "user":
            conversations.append(turns[: last + 1])
    if not conversations:
        raise EvalError(f"eval.context_source: {path} holds no conversation with an answered user turn")
    return conversations


CONTEXT_STRIDE = 7
"""Prompt i's context starts at conversation i * CONTEXT_STRIDE (cyclically), so prompts get different contexts."""


def with_context(messages: Messages, conversations: list[Messages], length: int, start: int, tokenizer) -> list[int]:
    """The prompt's ids behind as many whole conversations as fit within `length` tokens (taken in order from
    `start`, cyclically; one that does not fit is skipped), after the prompt's own system turn if it has one."""
    head = messages[:1] if messages[0]["role"] == "system" else []
    tail = messages[len(head) :]
    context: Messages = []
    ids = render(messages, tokenizer)
    for k in range(len(conversations)):
        longer = context + conversations[(start + k) % len(conversations)]
        longer_ids = render(head + longer + tail, tokenizer)
        if len(longer_ids) <= length:
            context, ids = longer, longer_ids
        elif context:  # full: the next conversation would overshoot
            break
    return ids


def load_prompts(
    path: str,
    tokenizer,
    limit: int | None,
    context_lengths: list[int] = (),
    conversations: list[Messages] | None = None,
) -> list[dict[str, Any]]:
    """[{index, id, input_ids, group}] from a JSONL file; errors name file:line. With `context_lengths`, every
    prompt once per length (all prompts at the first length, then at the second...), each entry with `context` (the
    length asked; 0 = the prompt alone) and an id `ID@LENGTH`."""
    if not Path(path).is_file():
        raise EvalError(f"eval.prompts: no such file {path}")
    prompts, chats = [], []
    for where, record in read_jsonl(path):
        if limit is not None and len(prompts) >= limit:
            break
        if isinstance(record, DataError):  # a line that is not JSON
            raise EvalError(str(record))
        ids = prompt_token_ids(record, tokenizer, where)
        group = record.get("category", record.get("kind"))  # MT-bench's categories, the SmolLM2 sets' kinds
        prompts.append({"index": len(prompts), "id": str(record.get("id", where)), "input_ids": ids, "group": group})
        chats.append((where, chat_turns(record, where, until_assistant=True)))
    if not prompts:
        raise EvalError(f"{path}: no prompts")
    if not context_lengths:
        return prompts
    out = []
    for length in context_lengths:
        for prompt, (where, messages) in zip(prompts, chats):
            if length and messages is None:
                raise EvalError(f"{where}: eval.context_lengths: only chat prompts can follow earlier conversation")
            start = prompt["index"] * CONTEXT_STRIDE
            ids = with_context(messages, conversations, length, start, tokenizer) if length else prompt["input_ids"]
            out.append(
                prompt | {"index": len(out), "id": f"{prompt['id']}@{length}", "input_ids": ids, "context": length}
            )
    return out


def stop_token_ids(target: Target) -> list[int]:
    """Where decoding stops: the target's EOS tokens, the tokenizer's, and `<|end|>` where the vocabulary has it
    (chat turns end there, as in data.selfdistill)."""
    eos = target.model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    stops = [target.tokenizer.eos_token_id]
    if END_OF_TURN in target.tokenizer.get_vocab():
        stops.append(target.tokenizer.convert_tokens_to_ids(END_OF_TURN))
    return eos + [t for t in stops if t is not None and t not in eos]

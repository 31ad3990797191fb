"""Chat templates and assistant-only loss masks, derived from the template itself.

    ids, mask = render_with_assistant_mask(normalize_messages(record), tokenizer)

The mask is never built from hand-tuned offsets. For every assistant turn i the conversation is
rendered twice: `messages[:i]` with the generation prompt and `messages[:i+1]` without it. The
second string extends the first by exactly the assistant turn as the template writes it: its
content and its end-of-turn marker (so the drafter learns to predict the end of a turn). Trailing
whitespace after the marker is template layout, not model output, and stays unmasked. The
character spans are mapped to tokens through the offsets of the full rendering, tokenized once.
Templates for which these renderings are not prefixes of each other cannot be masked this way and
raise `ChatTemplateError` naming the turn.
"""

from __future__ import annotations

from typing import Any

import jinja2

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
}


class DataError(ValueError):
    """A record that cannot be used; the message names where it is (file:line or record index) and why."""


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot yield an assistant mask (a template problem, not a data one)."""


def normalize_messages(record: dict[str, Any]) -> list[dict[str, str]]:
    """ShareGPT (`conversations`) or OpenAI (`messages`) record -> [{"role", "content"}, ...].

    Raises DataError for missing fields, unknown roles, non-text content, an empty conversation or
    one without an assistant turn. Trailing non-assistant turns are dropped (they carry no loss).
    """
    messages = turns_of(record)
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    if not messages:
        raise DataError("no assistant turn")
    if messages[0]["role"] == "assistant":
        raise DataError("turn 0: conversation starts with an assistant turn (needs a user or system turn first)")
    return messages


def turns_of(record: dict[str, Any]) -> list[dict[str, str]]:
    """Every turn of a ShareGPT (`conversations`) or OpenAI (`messages`) record as {"role", "content"}, in order.

    Raises DataError for missing fields, unknown roles, non-text content or an empty conversation."""
    if not isinstance(record, dict):
        raise DataError(f"a record must be a JSON object, got {type(record).__name__}")
    if record.get("conversations") is not None:
        turns, role_key, text_key, roles = record["conversations"], "from", "value", SHAREGPT_ROLES
    elif record.get("messages") is not None:
        turns, role_key, text_key, roles = record["messages"], "role", "content", {r: r for r in ROLES}
    else:
        raise DataError("no `conversations` or `messages` field")
    if not isinstance(turns, list):
        raise DataError(f"conversation must be a list of turns, got {type(turns).__name__}")
    if not turns:
        raise DataError("empty conversation")
    messages = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise DataError(f"turn {j}: needs `{role_key}` and `{text_key}`, got {str(turn)[:80]}")
        if not isinstance(turn[role_key], str) or turn[role_key] not in roles:
            raise DataError(f"turn {j}: unknown role {turn[role_key]!r} (known: {', '.join(roles)})")
        messages.append({"role": roles[turn[role_key]], "content": _text(turn[text_key], j)})
    return messages


def _text(content: Any, j: int) -> str:
    """Message content as a string; OpenAI content-part lists are joined when they are all text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise DataError(f"turn {j}: content must be text, got {type(content).__name__}")


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except jinja2.TemplateError as exc:
        # raise_exception() in templates (e.g. "roles must alternate") rejects this conversation.
        raise DataError(f"chat template rejected the conversation: {exc}") from None


def assistant_char_spans(
    messages: list[dict[str, str]], tokenizer: Any, cut_turns: frozenset[int] = frozenset()
) -> tuple[str, list[tuple[int, int]]]:
    """Render `messages`; return the text and the [start, end) character span of every assistant turn.

    Assistant turns whose number (0 = the first assistant turn) is in `cut_turns` were cut off by a length limit
    (self-distillation's `finish_reason: length`): their span ends with their text, without the end marker the
    template closes them with, which the model never produced there."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("tokenizer has no chat_template (use data.format: plain for base models)")
    text = _render(tokenizer, messages, generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], generation_prompt=True)
        upto = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        if not upto.startswith(before) or not text.startswith(upto):
            raise ChatTemplateError(
                f"assistant turn {i}: rendering the conversation up to this turn is not a prefix of the full "
                "rendering (the template rewrites earlier turns, e.g. strips reasoning or moves the system "
                f"prompt), so the assistant mask cannot be derived from it. Prefix ends with {upto[-60:]!r}"
            )
        turn = upto[len(before) :].rstrip()
        if not turn:
            raise ChatTemplateError(f"assistant turn {i}: the chat template renders nothing for assistant turns")
        if len(spans) in cut_turns and message["content"]:
            # the turn ends with its text, before the end marker; templates that trim (Llama-3's `| trim`) render
            # the text without its outer whitespace
            body = next((b for b in (message["content"], message["content"].strip()) if b and b in turn), None)
            if body is None and not message["content"].strip():
                # cut after whitespace only, which a trimming template renders as nothing: the turn ends where it
                # starts, and the end marker the template adds stays outside it, as for every cut turn
                spans.append((len(before), len(before)))
                continue
            if body is None:
                raise ChatTemplateError(
                    f"assistant turn {i} was cut at the length limit, but the template renders it without its text "
                    f"as given, so where the turn ends cannot be found (rendered: {turn[-80:]!r})"
                )
            turn = turn[: turn.index(body) + len(body)]
        spans.append((len(before), len(before) + len(turn)))
    return text, spans


def render_with_assistant_mask(
    messages: list[dict[str, str]], tokenizer: Any, cut_turns: frozenset[int] = frozenset()
) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a 0/1 mask that is 1 on assistant tokens (incl. end marker, except
    for the assistant turns in `cut_turns`, see `assistant_char_spans`)."""
    text, spans = assistant_char_spans(messages, tokenizer, cut_turns)
    # The rendered text already holds BOS and every marker the template wants; add nothing.
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise ChatTemplateError(
            f"{type(tokenizer).__name__} cannot return offsets; load a fast (tokenizers-backed) tokenizer"
        ) from None
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    mask = [0] * len(ids)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        if k == len(spans):
            break
        lo, hi = spans[k]
        # A token that straddles a span edge is partly assistant text, hence predicted: mask it.
        if (start < hi and end > lo) or (start == end and lo <= start < hi):
            mask[t] = 1
    return ids, mask


def render_with_turn_ids(
    messages: list[dict[str, str]],
    tokenizer: Any,
    turn_ids: list[list[int]],
    cut_turns: frozenset[int] = frozenset(),
    generation_prompt: bool = False,
) -> tuple[list[int], list[int]]:
    """Like `render_with_assistant_mask`, but every assistant turn is the token ids the target generated for it
    (`turn_ids[k]` for the k-th assistant turn, its stop token last unless a length limit cut it) instead of its
    text re-encoded: decoding then encoding does not give the same tokens back (a target that writes a paragraph
    break as two "\\n" tokens gets one "\\n\\n" from the tokenizer). The template text between assistant turns is
    encoded piece by piece, exactly as self-distillation encoded the prompt of each turn it generated.
    With `generation_prompt`, the rendering ends with the template's generation prompt (the input for the next
    assistant turn) and the mask is all zero there."""
    text, spans = assistant_char_spans(messages, tokenizer, cut_turns)
    if len(turn_ids) != len(spans):
        raise DataError(f"{len(turn_ids)} lists of assistant token ids for {len(spans)} assistant turns")
    if generation_prompt:
        full = _render(tokenizer, messages, generation_prompt=True)
        if not full.startswith(text):
            raise ChatTemplateError("the generation prompt is not appended to the rendered conversation")
        text = full
    ids: list[int] = []
    mask: list[int] = []
    end = 0
    for (lo, hi), generated in zip(spans, turn_ids):
        between = tokenizer(text[end:lo], add_special_tokens=False)["input_ids"] if lo > end else []
        ids += [*between, *generated]
        mask += [0] * len(between) + [1] * len(generated)
        end = hi
    tail = tokenizer(text[end:], add_special_tokens=False)["input_ids"] if end < len(text) else []
    return ids + tail, mask + [0] * len(tail)

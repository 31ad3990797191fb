"""Data preparation: template-derived assistant masks per template family, formats, truncation, errors.

    .venv/bin/pytest tests/test_prepare.py -q

Tokenizers are small byte-level BPEs trained in code, carrying each family's real chat template
(Qwen2.5 ChatML with its default system prompt, Llama-3 Instruct, Mistral-Instruct [INST]); the
pocket target's own tokenizer and template are tested from recipes/pocket/target.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from data.chat import ChatTemplateError, DataError, normalize_messages, render_with_assistant_mask, render_with_turn_ids
from data.prepare import (
    cap_repeat_runs,
    data_sources,
    format_masked,
    prepare_dataset,
    template_fingerprint,
    tokenize_record,
    vocab_fingerprint,
)
from data.repeats import REPEAT_NGRAM
from schema.sections import DataConfig

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"

# Real templates (Qwen2.5: the branches without tools; the tools branches do not run without tools).
QWEN25 = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    '{%- if (message.role == "user") or (message.role == "system" and not loop.first) '
    'or (message.role == "assistant" and not message.tool_calls) %}'
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
# Qwen3-style: earlier assistant turns lose their reasoning, so prefixes are not prefixes.
STRIPS_REASONING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

FAMILIES = {
    "qwen2": (QWEN25, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>"),
    "llama3": (
        LLAMA3,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
    "mistral": (MISTRAL, ["<s>", "</s>"], "<s>", "</s>"),
}
CORPUS = [
    "Hello there, how are you doing today?",
    "Fine, thanks. The weather is nice.",
    "What is two plus two? It is four.",
    "You are a helpful assistant. [INST] [/INST]",
] * 5
CONVERSATION = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "It is four."},
    {"role": "user", "content": "And the weather?"},
    {"role": "assistant", "content": "The weather is nice."},
]


def make_tokenizer(template: str | None, special: list[str], bos: str | None, eos: str) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
    out.chat_template = template
    return out


def family(name: str) -> PreTrainedTokenizerFast:
    return make_tokenizer(*FAMILIES[name])


@pytest.fixture(scope="module")
def pocket() -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(ROOT / "recipes/pocket/target")


def masked_runs(ids: list[int], mask: list[int], tokenizer) -> list[str]:
    """Decoded text of each maximal run of masked tokens."""
    runs, cur = [], []
    for t, m in zip([*ids, None], [*mask, 0]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tokenizer.decode(cur))
            cur = []
    return runs


@pytest.mark.parametrize(
    "name, end",
    [("qwen2", "<|im_end|>"), ("llama3", "<|eot_id|>"), ("mistral", "</s>")],
)
def test_mask_is_exactly_assistant_turns_plus_end_marker(name: str, end: str) -> None:
    tok = family(name)
    ids, mask = render_with_assistant_mask(CONVERSATION, tok)
    assert ids == tok(tok.apply_chat_template(CONVERSATION, tokenize=False), add_special_tokens=False)["input_ids"]
    assert masked_runs(ids, mask, tok) == [f"It is four.{end}", f"The weather is nice.{end}"]
    # The end marker itself is a masked token (the drafter must learn to end a turn).
    end_id = tok.convert_tokens_to_ids(end)
    assert [m for t, m in zip(ids, mask) if t == end_id][-1] == 1


def test_qwen2_default_system_prompt_is_rendered_and_unmasked() -> None:
    tok = family("qwen2")
    ids, mask = render_with_assistant_mask(CONVERSATION[:2], tok)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are Qwen")
    assert tok.decode([t for t, m in zip(ids, mask) if not m]).count("You are Qwen") == 1
    assert masked_runs(ids, mask, tok) == ["It is four.<|im_end|>"]
    # With an explicit system turn the default one is replaced, and the system turn stays unmasked.
    with_system = [{"role": "system", "content": "Be brief."}, *CONVERSATION[:2]]
    ids, mask = render_with_assistant_mask(with_system, tok)
    assert "You are Qwen" not in tok.decode(ids) and "Be brief." in tok.decode(ids)
    assert masked_runs(ids, mask, tok) == ["It is four.<|im_end|>"]


def test_pocket_template(pocket) -> None:
    ids, mask = render_with_assistant_mask(CONVERSATION, pocket)
    assert ids[0] == pocket.bos_token_id and ids.count(pocket.bos_token_id) == 1
    assert masked_runs(ids, mask, pocket) == ["It is four.<|end|>", "The weather is nice.<|end|>"]
    # The role tokens opening the assistant turns are prompt, not loss.
    assistant = pocket.convert_tokens_to_ids("<|assistant|>")
    assert all(m == 0 for t, m in zip(ids, mask) if t == assistant)


def test_template_that_rewrites_earlier_turns_is_rejected() -> None:
    tok = make_tokenizer(STRIPS_REASONING, ["<|im_start|>", "<|im_end|>"], None, "<|im_end|>")
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>hm</think>Hello"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye"},
    ]
    with pytest.raises(ChatTemplateError, match="assistant turn 1: .*not a prefix"):
        render_with_assistant_mask(messages, tok)
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        render_with_assistant_mask(messages, make_tokenizer(None, ["<|im_end|>"], None, "<|im_end|>"))


def test_template_exception_is_a_data_error() -> None:
    with pytest.raises(DataError, match="roles must alternate"):
        render_with_assistant_mask([CONVERSATION[0], CONVERSATION[2], CONVERSATION[1]], family("mistral"))


def test_normalize_sharegpt_and_openai() -> None:
    share = {
        "id": "x",
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "Q"},
            {"from": "gpt", "value": "A"},
            {"from": "human", "value": "dangling"},
        ],
    }
    assert normalize_messages(share) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
    ]
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "c"},
        ]
    }
    assert normalize_messages(parts) == [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "c"}]


def test_plain_mode(pocket) -> None:
    record = {"prompt": "The weather", "completion": " is nice."}
    ids, mask = tokenize_record(record, pocket, "auto", max_len=100)
    prompt = pocket("The weather", add_special_tokens=False)["input_ids"]
    completion = pocket(" is nice.", add_special_tokens=False)["input_ids"]
    assert ids == [pocket.bos_token_id, *prompt, *completion, pocket.eos_token_id]
    assert mask == [0] * (1 + len(prompt)) + [1] * (len(completion) + 1)
    ids, mask = tokenize_record(record, pocket, "plain", max_len=3)
    assert ids == [pocket.bos_token_id, *prompt, *completion][:3] and len(mask) == 3
    with pytest.raises(DataError, match="format is sharegpt but the record looks like plain"):
        tokenize_record(record, pocket, "sharegpt", max_len=100)


def test_self_distilled_ids_are_read_only_with_the_vocabulary_that_wrote_them(pocket) -> None:
    """Token ids carry their vocabulary's fingerprint (`generation.vocab`, written by self-distillation): read with
    another vocabulary of the same size they would be other tokens, so the record is refused, naming the field."""
    end = pocket.convert_tokens_to_ids("<|end|>")
    plain = {"prompt": "The weather", "completion": " is nice.", "completion_ids": [17, 18, end]}
    chat = {"messages": CONVERSATION, "assistant_ids": [[17, end], [18, end]]}
    for record, turns in ((plain, 1), (chat, 2)):
        ours = {**record, "generation": {"vocab": vocab_fingerprint(pocket), "finish_reason": ["stop"] * turns}}
        tokenize_record(ours, pocket, "auto", max_len=1000)
        foreign = {**ours, "generation": {**ours["generation"], "vocab": "0123456789abcdef"}}
        with pytest.raises(DataError, match=r"^`generation.vocab`: its token ids were written with another vocabulary"):
            tokenize_record(foreign, pocket, "auto", max_len=1000)
        tokenize_record({k: v for k, v in foreign.items() if not k.endswith("_ids")}, pocket, "auto", max_len=1000)


def test_cut_off_generations_teach_no_ending(pocket) -> None:
    """Self-distilled turns that hit the length limit did not end: no EOS after a cut completion, and a cut assistant
    turn's end marker (which the template adds) is not a loss token; turns that stopped keep theirs."""
    record = {"prompt": "The weather", "completion": " is nice.", "generation": {"finish_reason": ["length"]}}
    ids, mask = tokenize_record(record, pocket, "auto", max_len=100)
    assert ids[-1] != pocket.eos_token_id and mask[-1] == 1
    stopped = {**record, "generation": {"finish_reason": ["stop"]}}
    assert tokenize_record(stopped, pocket, "auto", max_len=100).input_ids[-1] == pocket.eos_token_id

    # self-distilled ids are trained on as they are: the target's tokens, its stop token (if any) included
    exact = {**record, "completion_ids": [17, 18, pocket.convert_tokens_to_ids("<|end|>")]}
    ids, mask = tokenize_record(exact, pocket, "auto", max_len=100)
    prompt = pocket("The weather", add_special_tokens=False)["input_ids"]
    assert ids == [pocket.bos_token_id, *prompt, *exact["completion_ids"]] and mask[-4:] == [0, 1, 1, 1]
    with pytest.raises(DataError, match="completion_ids"):
        tokenize_record({**record, "completion_ids": [len(pocket)]}, pocket, "auto", max_len=100)

    chat = {"messages": CONVERSATION, "generation": {"finish_reason": ["stop", "length"]}}
    ids, mask = tokenize_record(chat, pocket, "auto", max_len=1000)
    assert masked_runs(ids, mask, pocket) == ["It is four.<|end|>", "The weather is nice."]
    assert ids == render_with_assistant_mask(CONVERSATION, pocket)[0]  # the same tokens, one mask bit less


def cut_conversation(tok, first: str) -> tuple[list[dict], list[list[int]], int]:
    """Two questions; the first answer, `first`, was cut at the length limit (its ids have no stop token), the second
    stopped. -> (messages, each answer's generated ids, the end-of-turn id)."""
    messages = [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "And the weather?"},
        {"role": "assistant", "content": "The weather is nice."},
    ]
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    cut = tok(first, add_special_tokens=False)["input_ids"]
    stopped = tok("The weather is nice.", add_special_tokens=False)["input_ids"] + [eot]
    return messages, [cut, stopped], eot


def test_a_cut_turn_keeps_its_end_marker_under_a_trimming_template() -> None:
    """Llama-3's template trims each turn's text: a turn cut on a newline is rendered without it. Its span still ends
    before the end marker, so the marker stays in the conversation (self-distillation's next prompt, and the ids
    spliced in for the turn) and is not a loss token."""
    tok = family("llama3")
    messages, (cut, stopped), eot = cut_conversation(tok, "It is four.\n")  # cut right after a newline
    ids, mask = render_with_turn_ids(messages, tok, [cut, stopped], frozenset({0}))
    assert ids.count(eot) == 4  # both users' turns, the cut turn's (from the template) and the stopped one's
    assert masked_runs(ids, mask, tok) == ["It is four.\n", "The weather is nice.<|eot_id|>"]
    prompt, _ = render_with_turn_ids(messages[:3], tok, [cut], frozenset({0}), generation_prompt=True)
    assert tok.decode(prompt).count("<|eot_id|>") == 3
    record = {"messages": messages, "generation": {"finish_reason": ["length", "stop"]}}
    ids, mask = tokenize_record(record, tok, "auto", max_len=1000)  # the text route
    assert masked_runs(ids, mask, tok) == ["It is four.", "The weather is nice.<|eot_id|>"]


def test_a_turn_cut_to_whitespace_keeps_its_end_marker_under_a_trimming_template() -> None:
    """A turn the length limit cut after whitespace only renders as nothing under a trimming template: it is an
    empty turn that ends where it starts, its generated ids stay loss tokens and the template's end marker stays
    outside it (a template error used to stop self-distillation at this conversation on every resume)."""
    tok = family("llama3")
    messages, (cut, stopped), eot = cut_conversation(tok, "\n\n")  # cut before any visible text
    ids, mask = render_with_turn_ids(messages, tok, [cut, stopped], frozenset({0}))
    assert ids.count(eot) == 4 and masked_runs(ids, mask, tok) == ["\n\n", "The weather is nice.<|eot_id|>"]
    prompt, _ = render_with_turn_ids(messages[:3], tok, [cut], frozenset({0}), generation_prompt=True)
    assert tok.decode(prompt).count("<|eot_id|>") == 3  # self-distillation's prompt for the next turn
    record = {"messages": messages, "generation": {"finish_reason": ["length", "stop"]}}
    with pytest.raises(DataError, match="turn 1: empty assistant turn"):  # the text route: a record to skip
        tokenize_record(record, tok, "auto", max_len=1000)
    qwen = family("qwen2")  # a template that keeps whitespace: the turn holds its "\n\n", once
    end = qwen.convert_tokens_to_ids("<|im_end|>")
    generated = [qwen(text, add_special_tokens=False)["input_ids"] for text in ("\n\n", "The weather is nice.")]
    ids, _ = render_with_turn_ids(messages, qwen, [generated[0], generated[1] + [end]], frozenset({0}))
    assert qwen.decode(ids) == qwen.apply_chat_template(messages, tokenize=False)


def write_jsonl(path: Path, lines: list) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


SHARE = {"id": "s1", "conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}]}
OPENAI = {"messages": [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]}
PLAIN = {"prompt": "P3", "completion": " C3"}


def test_auto_format_ids_and_stats(tmp_path: Path, pocket) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [SHARE, OPENAI, ""])  # blank lines are not records
    b = write_jsonl(tmp_path / "b.jsonl", [PLAIN, SHARE])
    data = prepare_dataset(DataConfig(train_files=[a, b]), pocket)
    assert [s["id"] for s in data.samples] == [0, 1, 2, 3]
    assert (data.num_records, data.num_skipped, data.num_truncated, data.num_dropped) == (4, 0, 0, 0)
    masked = [pocket.decode([t for t, m in zip(s["input_ids"], s["loss_mask"]) if m]) for s in data.samples]
    assert masked == ["A1<|end|>", "A2<|end|>", " C3<|eos|>", "A1<|end|>"]
    assert format_masked(data.samples[0], pocket) == "<|bos|><|user|>\nQ1<|end|>\n<|assistant|>\n[[A1<|end|>]]\n"
    assert data.stats()["loss_tokens"] == sum(sum(s["loss_mask"]) for s in data.samples)
    assert len(prepare_dataset(DataConfig(train_files=[a, b], max_samples=2), pocket).samples) == 2


def test_max_loss_tokens_stops_at_the_sample_that_reaches_it(tmp_path: Path, pocket) -> None:
    records = [{"prompt": f"P{i}", "completion": " " + "word " * (i + 1)} for i in range(6)]
    path = write_jsonl(tmp_path / "a.jsonl", records)
    whole = prepare_dataset(DataConfig(train_files=[path]), pocket).samples
    counts = [sum(s["loss_mask"]) for s in whole]
    reach = counts[0] + counts[1] + 1  # inside the third sample: the third is kept, the fourth is not read
    data = prepare_dataset(DataConfig(train_files=[path], max_loss_tokens=reach), pocket)
    assert [s["id"] for s in data.samples] == [0, 1, 2]
    assert data.num_records == 3
    exact = prepare_dataset(DataConfig(train_files=[path], max_loss_tokens=counts[0] + counts[1]), pocket)
    assert [s["id"] for s in exact.samples] == [0, 1]
    assert data_sources(DataConfig(train_files=[path], max_loss_tokens=reach))["max_loss_tokens"] == reach


def test_a_loop_keeps_its_first_tokens_in_the_loss_and_a_sample_ending_in_one_is_cut() -> None:
    """Prompt tokens are never a loop's first turn; a run of repeating answer tokens keeps `keep` of them; a
    non-repeating token or a prompt token ends the run; a tail with only template tokens after it is cut."""
    prompt, fresh, loop = [1, 2, 3, 4, 5, 6, 7, 8, 9], [20, 21, 22], [30, 31, 32, 33]
    ids = prompt + fresh + loop * 10 + [99, 98]  # [99, 98]: the template's closing tokens, no loss
    mask = [0] * len(prompt) + [1] * (len(fresh) + 40) + [0, 0]
    start = len(prompt) + len(fresh)
    # the first repeating token is the first whose 8-gram lies inside the loop and ended one period (4) earlier too
    first = start + REPEAT_NGRAM + len(loop) - 1
    for keep in (0, 5):
        got_ids, got_mask, left = cap_repeat_runs(ids, mask, keep)
        assert got_ids == ids[: first + keep] and got_mask == mask[: first + keep]
        assert left == sum(mask) - sum(got_mask) == 40 - (first - start) - keep
    assert cap_repeat_runs(ids, mask, 100) == (ids, mask, 0)  # runs shorter than the cap: untouched

    # a second answer after a user turn: the first answer's tail is taken out of the loss, not cut
    second = [7, 7, 50, 51, 52]
    ids2, mask2 = ids + second, mask + [0, 0, 1, 1, 1]
    got_ids, got_mask, left = cap_repeat_runs(ids2, mask2, 2)
    assert got_ids == ids2 and left == 40 - (first - start) - 2
    assert sum(got_mask[: first + 2]) == sum(mask2[: first + 2]) and got_mask[-3:] == [1, 1, 1]
    # the prompt's own text is not answer text: an answer copying it is not a loop
    copy = prompt + prompt + [0]
    assert cap_repeat_runs(copy, [0] * 9 + [1] * 10, 0) == (copy, [0] * 9 + [1] * 10, 0)


def test_max_repeat_run_takes_loops_out_of_the_loss_and_is_a_data_source(tmp_path: Path, pocket) -> None:
    loop = {
        "prompt": "Loop.",
        "completion": " alpha beta gamma delta" * 30,
        "generation": {"finish_reason": ["length"]},
    }
    records = [loop, {"prompt": "Q?", "completion": " A."}]  # the loop ran into the length limit: no eos after it
    path = write_jsonl(tmp_path / "a.jsonl", records)
    whole = prepare_dataset(DataConfig(train_files=[path]), pocket)
    capped = prepare_dataset(DataConfig(train_files=[path], max_repeat_run=16), pocket)
    assert capped.samples[1] == whole.samples[1]  # no loop: as without the cap
    loop, kept = whole.samples[0], capped.samples[0]
    assert (
        len(kept["input_ids"]) < len(loop["input_ids"])
        and kept["input_ids"] == loop["input_ids"][: len(kept["input_ids"])]
    )
    assert capped.stats()["repeats_left_out"] == sum(loop["loss_mask"]) - sum(kept["loss_mask"]) > 0
    assert whole.stats()["repeats_left_out"] is None
    assert data_sources(DataConfig(train_files=[path], max_repeat_run=16))["max_repeat_run"] == 16


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"conversations": [', "bad JSON"),
        ({"text": "hi"}, "cannot detect format"),
        ({"conversations": [{"from": "human"}]}, "turn 0: needs `from` and `value`"),
        ({"conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "y"}]}, "unknown role 'robot'"),
        ({"messages": []}, "empty conversation"),
        ({"messages": [{"role": "user", "content": "only a question"}]}, "no assistant turn"),
        ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]}, "must be text"),
        ({"prompt": "p", "completion": 5}, "string `completion`"),
        ({"prompt": "p", "completion": ""}, "empty completion"),
        ({"prompt": "p", "completion": " \n "}, "empty completion"),
        ({"prompt": "p", "completion": "", "completion_ids": []}, "`completion_ids` is empty"),
        ([1, 2], "must be a JSON object"),
        ({"conversations": [{"from": ["human"], "value": "x"}, {"from": "gpt", "value": "y"}]}, "unknown role"),
        ({"prompt": "p", "completion": "c", "generation": "x"}, "`generation` must be an object"),
        ({"prompt": "p", "completion": "c", "completion_ids": [1, 2], "generation": "x"}, "`generation` must be an"),
        ({"prompt": "p", "completion": "c", "generation": {"finish_reason": "length"}}, "finish_reason` must be a"),
        ({"prompt": "p", "completion": "c", "generation": {"finish_reason": [5]}}, "finish_reason` must be a list"),
    ],
)
def test_malformed_records(tmp_path: Path, pocket, line, problem: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [SHARE, line, OPENAI])
    with pytest.raises(DataError, match=f"bad.jsonl:2: .*{problem}"):
        prepare_dataset(DataConfig(train_files=[path]), pocket)
    data = prepare_dataset(DataConfig(train_files=[path], skip_malformed=True), pocket)
    assert (data.num_records, data.num_skipped, [s["id"] for s in data.samples]) == (3, 1, [0, 2])


def test_truncation_keeps_beginning_and_drops_maskless(tmp_path: Path, pocket) -> None:
    long_prompt = {"messages": [{"role": "user", "content": "word " * 60}, {"role": "assistant", "content": "ok"}]}
    long_answer = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "word " * 60}]}
    path = write_jsonl(tmp_path / "t.jsonl", [long_prompt, long_answer, SHARE])
    full = tokenize_record(long_answer, pocket, "auto", max_len=10_000)
    data = prepare_dataset(DataConfig(train_files=[path], max_len=20), pocket)
    assert (data.num_truncated, data.num_dropped) == (1, 1)
    assert [s["id"] for s in data.samples] == [1, 2]
    assert data.samples[0]["input_ids"] == full.input_ids[:20] and data.samples[0]["loss_mask"] == full.loss_mask[:20]


def test_hf_dataset_source(tmp_path: Path, pocket) -> None:
    folder = tmp_path / "ds"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [OPENAI, OPENAI])
    from_dir = prepare_dataset(DataConfig(hf_dataset=str(folder), hf_split="train"), pocket)
    from_jsonl = prepare_dataset(DataConfig(train_files=[str(folder / "train.jsonl")]), pocket)
    assert from_dir.samples == from_jsonl.samples and len(from_dir.samples) == 2


def test_template_fingerprint(pocket) -> None:
    qwen = family("qwen2")
    assert template_fingerprint(qwen) == template_fingerprint(family("qwen2"))
    assert len(template_fingerprint(qwen)) == 16
    changed = family("qwen2")
    changed.chat_template = QWEN25.replace("You are Qwen", "You are Pwen")
    assert template_fingerprint(changed) != template_fingerprint(qwen)
    assert template_fingerprint(pocket) != template_fingerprint(qwen)


def test_cli_shows_masked_samples(tmp_path: Path, capsys) -> None:
    from data.prepare import main

    data = write_jsonl(tmp_path / "d.jsonl", [SHARE, OPENAI])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"target: {{path: {ROOT / 'recipes/pocket/target'}}}\n"
        f"data: {{train_files: [{data}]}}\n"
        "drafter: {method: medusa1}\n"
    )
    main([str(recipe), "data.max_samples=1", "--show", "1"])
    out = capsys.readouterr().out
    stats = json.loads(out[: out.index("\n---")])
    assert (stats["records"], stats["samples"]) == (1, 1)
    assert "[[A1<|end|>]]" in out and "A2" not in out

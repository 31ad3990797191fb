"""data.synthesize: the target writes user requests from its template's user prefix; filters, de-duplication, resume,
process counts and refusals, on the pocket target (a real pretrained model with a chat template)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from tiny import accelerate_launch
from transformers import AutoModelForCausalLM, AutoTokenizer

from data.requests import NearDuplicates
from data.selfdistill import read_prompts
from data.synthesize import (
    FilterSettings,
    Kind,
    SynthesizeError,
    main,
    read_kinds,
    rejection,
    select,
    template_markers,
    turn_end_ids,
    user_prefix,
)

ROOT = Path(__file__).resolve().parents[1]
POCKET = ROOT / "recipes" / "pocket" / "target"
RELAXED = ["--language", "any", "--min-words", "1", "--near-duplicate", "1"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(POCKET)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """The pocket target, which rarely ends a user turn by itself (it learned chat from few examples), with its
    `<|end|>` logit raised by about 10 on its typical final hidden states, so that some requests end."""
    path = tmp_path_factory.mktemp("ending-target")
    tok = AutoTokenizer.from_pretrained(POCKET)
    model = AutoModelForCausalLM.from_pretrained(POCKET, dtype=torch.float32)
    ids = tok("def f(x):\n    return x + 1\nHow do I sort a list in Python?", return_tensors="pt").input_ids
    with torch.no_grad():
        mean = model(ids, output_hidden_states=True).hidden_states[-1][0].mean(0)  # (d,)
        model.lm_head.weight[tok.convert_tokens_to_ids("<|end|>")] += 10 * mean / mean.norm() ** 2
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def synthesize(target: Path, out: Path, *extra: str, count: int = 16) -> list[dict]:
    main(["--target", str(target), "--out", str(out), "--count", str(count), "--batch-size", "4"]
         + ["--max-new-tokens", "64", "--dtype", "float32", *extra])  # fmt: skip
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_the_user_prefix_is_the_template_up_to_the_users_words(tokenizer):
    """prefix + request + the closing text is exactly the template's rendering of a one-turn conversation, for the
    pocket template and a ChatML one, with and without a system turn; the opener follows the prefix."""
    request = "How do I sort a list of tuples by their second item?"
    for template in (tokenizer.chat_template, CHATML):
        tok = AutoTokenizer.from_pretrained(POCKET)
        tok.chat_template = template
        if template is CHATML:
            tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        for kind in (Kind("plain"), Kind("steered", system="Users ask about Python.", opener="How do")):
            ids, after = user_prefix(tok, kind)
            messages = ([{"role": "system", "content": kind.system}] if kind.system else []) + [
                {"role": "user", "content": request if kind.opener is None else "How do I sort"}
            ]
            rendered = tok.apply_chat_template(messages, tokenize=False)
            prefix_text = tok.decode(ids)
            assert rendered == prefix_text + messages[-1]["content"][len(kind.opener or "") :] + after
            assert prefix_text.endswith(kind.opener or "")
        stop = turn_end_ids(tok, after)
        assert tok.convert_ids_to_tokens(stop) == (["<|end|>"] if template is not CHATML else ["<|im_end|>"])


def test_a_plain_newline_never_ends_a_request(tokenizer):
    assert turn_end_ids(tokenizer, "\n\nAssistant:") == []


def test_each_filter_names_its_reason(tokenizer):
    markers, cfg = template_markers(tokenizer), FilterSettings()
    cases = {
        "What is the capital of France and why?": None,
        "": "empty",
        "Hi there": "too short",
        " ".join(["word"] * 201) + " the": "too long",
        "What is <|assistant|> the answer to this?": "template text",
        "Qu'est-ce que c'est, ce truc là?": "not English",
        "Was ist das für ein Ding, bitte sehr?": "not English",
        "Sure, here is a poem about the sea for you.": "answer or refusal",
        "I'm sorry, but I cannot help with that request.": "answer or refusal",
        "What is the the the the the the the the the the?": "repetitive",
    }
    for text, why in cases.items():
        assert rejection(text, "stop", markers, cfg) == why, text
    assert rejection("What is the capital of France and why?", "length", markers, cfg) == "unfinished"
    assert rejection("Дай мне рецепт борща, пожалуйста", "stop", markers, FilterSettings(language="any")) is None


def test_duplicates_and_near_duplicates_are_removed_in_candidate_order(tokenizer):
    texts = [
        "How can I improve my sleep schedule when I work night shifts at a hospital?",
        "How can I improve my SLEEP schedule, when I work night shifts at a hospital",  # the same words
        "How can I improve my sleep schedule when I work night shifts at a busy hospital?",  # one word added
        "What are good ways to learn the basics of the French language quickly?",
        "Write a short poem about autumn leaves falling in the quiet park at dusk.",
    ]
    candidates = [{"candidate": i, "text": t, "finish_reason": "stop"} for i, t in enumerate(texts)]
    kept, removed = select(candidates, template_markers(tokenizer), FilterSettings())
    assert [c["candidate"] for c in kept] == [0, 3, 4]
    assert removed == {"duplicate": 1, "near duplicate": 1}
    loose = select(candidates, template_markers(tokenizer), FilterSettings(near_duplicate=1.0))[0]
    assert [c["candidate"] for c in loose] == [0, 2, 3, 4]


def test_minhash_estimates_jaccard_similarity():
    """The share of equal MinHash values estimates the Jaccard similarity of the word 3-gram sets."""
    near = NearDuplicates(0.5, num_perm=256, bands=64)
    base = [f"w{i}" for i in range(60)]
    other = base[:45] + [f"x{i}" for i in range(15)]  # 43 of 58 + 15 + ... 3-grams shared
    a, b = near.signature(" ".join(base)), near.signature(" ".join(other))
    grams = lambda ws: {tuple(ws[i : i + 3]) for i in range(len(ws) - 2)}
    jaccard = len(grams(base) & grams(other)) / len(grams(base) | grams(other))
    assert abs(float((a == b).mean()) - jaccard) < 0.1


def test_synthesized_prompts_are_chat_records_with_provenance(target, tmp_path):
    out = tmp_path / "prompts.jsonl"
    kinds = tmp_path / "kinds.yaml"
    kinds.write_text("kinds:\n  - {name: general}\n  - {name: howto, opener: 'How do I'}\n")
    records = synthesize(target, out, "--kinds", str(kinds), *RELAXED)
    candidates = [json.loads(line) for line in (tmp_path / "prompts.jsonl.candidates.jsonl").read_text().splitlines()]
    assert [c["candidate"] for c in candidates] == list(range(16))
    meta = json.loads((tmp_path / "prompts.jsonl.meta.json").read_text())
    assert meta["candidates"] == 16 and meta["kept"] == len(records) >= 1
    assert meta["kept"] + sum(meta["removed"].values()) == 16
    by_candidate = {c["candidate"]: c for c in candidates}
    for record in records:
        cand = by_candidate[record["source"]["candidate"]]
        assert record["id"] == f"synth-{cand['candidate']:07d}" and cand["finish_reason"] == "stop"
        assert record["messages"] == [{"role": "user", "content": cand["text"].strip()}]
        assert record["kind"] == ("general", "howto")[cand["candidate"] % 2]
        assert record["source"]["method"] == "magpie" and record["source"]["seed"] == cand["seed"]
    for cand in candidates[1::2]:
        assert cand["text"].startswith("How do I")
    assert len(read_prompts(out, None)) == len(records)  # data.selfdistill reads them as they are


def test_a_killed_run_resumes_and_a_larger_count_extends(target, tmp_path):
    whole = tmp_path / "whole" / "p.jsonl"
    whole.parent.mkdir()
    synthesize(target, whole, *RELAXED)
    reference = (tmp_path / "whole" / "p.jsonl.candidates.jsonl").read_text()

    part = tmp_path / "part" / "p.jsonl"
    part.parent.mkdir()
    synthesize(target, part, *RELAXED, count=8)  # a smaller --count first
    cands = tmp_path / "part" / "p.jsonl.candidates.jsonl"
    lines = cands.read_text().splitlines(keepends=True)
    cands.write_text("".join(lines[:5]) + lines[5][:20])  # killed mid-write: a torn last line
    synthesize(target, part, *RELAXED)
    assert cands.read_text() == reference
    assert part.read_text() == whole.read_text()


def test_two_processes_write_the_candidates_of_one(target, tmp_path):
    one = tmp_path / "one.jsonl"
    synthesize(target, one, *RELAXED, count=8)
    launch = accelerate_launch("--multi_gpu", "--num_processes", "2")
    args = ["-m", "data.synthesize", "--target", str(target), "--out", str(tmp_path / "two.jsonl"), "--count", "8"]
    args += ["--batch-size", "4", "--max-new-tokens", "64", "--dtype", "float32", *RELAXED]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launch, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[1/2]" in done.stderr  # the second process did generate
    two = (tmp_path / "two.jsonl.candidates.jsonl").read_text()
    assert two == (tmp_path / "one.jsonl.candidates.jsonl").read_text()
    assert (tmp_path / "two.jsonl").read_text() == one.read_text()


def test_other_settings_are_refused_and_filters_rerun(target, tmp_path):
    out = tmp_path / "p.jsonl"
    synthesize(target, out, *RELAXED, count=4)
    with pytest.raises(SynthesizeError, match=r"--temperature 1.0 there, 0.7 now"):
        synthesize(target, out, *RELAXED, "--temperature", "0.7", count=4)
    kinds = tmp_path / "k.yaml"
    kinds.write_text("kinds: [{name: other, opener: Why}]\n")
    with pytest.raises(SynthesizeError, match="other kinds"):
        synthesize(target, out, *RELAXED, "--kinds", str(kinds), count=4)
    # other filters need no new candidates: the strict defaults keep fewer of the same
    strict = synthesize(target, out, count=4)
    meta = json.loads((tmp_path / "p.jsonl.meta.json").read_text())
    assert meta["filters"]["language"] == "en" and len(strict) == meta["kept"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("kinds: []\n", "a non-empty list"),
        ("kinds: [{opener: Why}]\n", r"kinds\[0\]: needs a `name`"),
        ("kinds: [{name: a, topic: x}]\n", r"unknown keys \['topic'\]"),
        ("kinds: [{name: a}, {name: a}]\n", "duplicate name 'a'"),
        ("kinds: [{name: a, opener: ''}]\n", "`opener` must be a non-empty string"),
        ("kinds: [\n", "not valid YAML"),
    ],
)
def test_bad_kinds_files_are_named(tmp_path, text, message):
    path = tmp_path / "kinds.yaml"
    path.write_text(text)
    with pytest.raises(SynthesizeError, match=message) as info:
        read_kinds(path)
    assert str(path) in str(info.value)


def test_a_target_without_chat_template_is_one_line(tmp_path):
    target = tmp_path / "base"
    shutil.copytree(POCKET, target)
    (target / "chat_template.jinja").unlink()
    done = subprocess.run(
        [os.sys.executable, "-m", "data.synthesize", "--target", str(target), "--out", str(tmp_path / "p.jsonl"),
         "--count", "2"], cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "no chat template" in done.stderr


def test_a_second_synthesis_into_the_same_out_is_refused(target, tmp_path):
    from rundir.lock import acquire, release

    out = tmp_path / "p.jsonl"
    held = acquire(out, "synthesis", beside=True)  # another run writing there
    try:
        with pytest.raises(SynthesizeError, match=r"--out: .*p.jsonl: another synthesis is writing there"):
            synthesize(target, out, *RELAXED, count=4)
        assert not (tmp_path / "p.jsonl.candidates.jsonl").exists()
    finally:
        release(held)
    synthesize(target, out, *RELAXED, count=4)  # free again: it generates all 4 candidates and filters them into out
    assert len((tmp_path / "p.jsonl.candidates.jsonl").read_text().splitlines()) == 4

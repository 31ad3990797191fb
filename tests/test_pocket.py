"""The shipped pocket target: tokenizer, recipe config, weights and their recorded greedy output."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

POCKET = Path(__file__).resolve().parents[1] / "recipes" / "pocket"
TARGET = POCKET / "target"
from recipes.pocket.pretrain import PretrainConfig  # noqa: E402
from recipes.pocket.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, VOCAB_SIZE  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TARGET)


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n    return {'a': [1, 2.5e-3]}  # comment\n\n\n",
        "Ünïcödé — naïve café, 日本語, emoji 🐍\ttab  and trailing spaces   ",
        "\n\n   .. note::\n\n      ``code`` and *emphasis*\r\n",
        "",
    ],
)
def test_tokenizer_round_trips(tok, text):
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_specials_and_chat_template(tok):
    assert len(tok) == VOCAB_SIZE
    assert tok.convert_ids_to_tokens(list(range(len(SPECIAL_TOKENS)))) == SPECIAL_TOKENS
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert tok.chat_template == CHAT_TEMPLATE
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|bos|><|system|>\nS<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    full = tok.apply_chat_template(chat + [{"role": "assistant", "content": "Yo"}], tokenize=False)
    assert full.startswith(prompt[: -len("<|assistant|>\n")]) and full.endswith("<|assistant|>\nYo<|end|>\n")
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.bos_token_id) == 1 and ids[-2] == tok.convert_tokens_to_ids("<|assistant|>")


def test_recipe_config_loads():
    path = POCKET / "pretrain.yaml"
    cfg = PretrainConfig.from_yaml(path)
    assert cfg.model["vocab_size"] == VOCAB_SIZE
    assert cfg.export_dir == "recipes/pocket/target" and cfg.tokenizer == "recipes/pocket/target"
    assert path.read_text().startswith("# accelerate launch recipes/pocket/pretrain.py recipes/pocket/pretrain.yaml\n")
    stage2 = PretrainConfig.from_yaml(POCKET / "pretrain-stage2.yaml")
    assert stage2.model == cfg.model and stage2.tokenizer == cfg.tokenizer and stage2.export_dir == cfg.export_dir
    assert stage2.init_from == f"{cfg.out_dir}/checkpoint" and stage2.out_dir != cfg.out_dir
    assert stage2.seed != cfg.seed  # other batches than stage 1's


def test_shipped_target_matches_recipe():
    cfg = PretrainConfig.from_yaml(POCKET / "pretrain.yaml")
    model = AutoModelForCausalLM.from_pretrained(TARGET)
    for key, value in cfg.model.items():
        if key != "rope_theta":
            assert getattr(model.config, key) == value, key
    assert model.config.rope_parameters["rope_theta"] == cfg.model["rope_theta"]
    assert model.config.model_type == "llama"
    assert (TARGET / "model.safetensors").stat().st_size <= 25e6
    assert set(model.generation_config.eos_token_id) == {1, 6}  # <|eos|>, <|end|>


def test_greedy_continuation_matches_record(tok):
    reference = json.loads((TARGET / "greedy_reference.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=getattr(torch, reference["dtype"])).eval()
    ids = torch.tensor([[tok.bos_token_id] + tok(reference["prompt"], add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=reference["max_new_tokens"]
        )
    assert out[0, ids.shape[1] :].tolist() == reference["token_ids"]
    assert tok.decode(reference["token_ids"]) == reference["text"]


def test_a_larger_prompt_set_holds_every_prompt_of_a_smaller_one(tmp_path):
    """Data-scaling runs build more training prompts (`prompts.py --train-size`); the smaller set must be a subset,
    so the bundled 3,000 are among them and comparisons across sizes add data rather than swap it. Asking for more
    than the split holds fails naming the file."""
    from recipes.pocket.prompts import split_prompts

    def doc(i: int) -> dict:
        blocks = [" ".join(f"w{i}_{b}_{k}" for k in range(40 + (i * 7 + b) % 30)) + "\n" for b in range(6)]
        return {"path": f"pkg/mod{i}.py", "text": "\n".join(blocks)}

    (tmp_path / "train.jsonl").write_text("".join(json.dumps(doc(i)) + "\n" for i in range(12)))
    n_words = lambda text: len(text.split())  # noqa: E731
    small, large = (split_prompts(tmp_path, "train", n, n_words) for n in (20, 50))
    assert len(small) == 20 and len(large) == 50
    assert {r["id"] for r in small} < {r["id"] for r in large}
    by_id = {r["id"]: r["prompt"] for r in large}
    assert all(by_id[r["id"]] == r["prompt"] for r in small)
    assert all(32 <= n_words(r["prompt"]) <= 96 for r in large)
    with pytest.raises(ValueError, match=r"train\.jsonl: only \d+ prompts of 32-96 tokens, 1000 asked for"):
        split_prompts(tmp_path, "train", 1000, n_words)

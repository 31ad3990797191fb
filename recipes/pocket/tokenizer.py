"""Train the pocket target's byte-level BPE tokenizer on the corpus train split.

    python recipes/pocket/tokenizer.py --corpus artifacts/pocket-corpus --out recipes/pocket/target

Byte-level BPE (GPT-2 style pre-tokenization, no prefix space), vocab 8192 including the
special tokens below (ids 0..6 in this order). Encoding adds `<|bos|>` in front of plain text,
exactly as pretraining sees every document (`<|bos|> text <|eos|>`). Chat prompts come from the
chat template, which writes `<|bos|>` itself (so tokenize rendered chats with
add_special_tokens=False, as `apply_chat_template(tokenize=True)` does). Every turn ends with
`<|end|>`, so an assistant learns to emit it; generation stops on `<|eos|>` or `<|end|>`.
"""

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROUND_TRIP_SAMPLES = [
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "Ünïcödé — naïve café, 日本語, emoji 🐍, tabs\tand  double  spaces.",
    "   leading spaces and trailing newline\n",
]


def iter_texts(corpus: Path) -> Iterator[str]:
    with open(corpus / "train.jsonl", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def train_tokenizer(corpus: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(iter_texts(corpus), trainer=trainer)
    bos_id = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def check_round_trip(tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tok) == VOCAB_SIZE, len(tok)
    for text in ROUND_TRIP_SAMPLES:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == text, (text, tok.decode(ids))
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    rendered = tok.apply_chat_template(chat, tokenize=False)
    assert rendered == "<|bos|><|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n", rendered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    train_tokenizer(args.corpus).save_pretrained(args.out)
    check_round_trip(args.out)
    print(f"tokenizer (vocab {VOCAB_SIZE}) -> {args.out}")


if __name__ == "__main__":
    main()

"""Regenerate RoundPipe's demo corpus and tokenizer.

The demo (``roundpipe demo``, ``demo_job.yaml``) must show a falling loss within a few
dozen optimizer steps of a tiny randomly initialised model, on a CPU, with nothing
downloaded. So the corpus is small, original and very regular: short paragraphs built
from a handful of sentence templates about numbers, arithmetic, days, months, colours
and animals. A model learns the templates quickly and the arithmetic/successor facts
more slowly, which keeps the loss curve interesting for longer than one epoch.

Outputs, next to this file:

    demo_corpus.jsonl        one JSON object per line: {"text": "<paragraph>"}
    tokenizer/tokenizer.json byte-level BPE (vocabulary of ``VOCAB_SIZE`` incl. specials)
    tokenizer/tokenizer_config.json
                             PreTrainedTokenizerFast settings: eos ``<|endoftext|>``,
                             pad ``<|pad|>``; loads with
                             ``AutoTokenizer.from_pretrained(dir, local_files_only=True)``
    demo_chat.jsonl          ``NUM_CONVERSATIONS`` conversations, {"messages": [...]}
                             per line: questions about the corpus' facts, one to three
                             turns, some with a system message (``roundpipe demo --chat``)
    chat_tokenizer/          the same BPE plus ``<|im_start|>`` / ``<|im_end|>`` (vocabulary
                             ``CHAT_VOCAB_SIZE``) and a ChatML-style chat template with
                             ``{% generation %}`` markers (assistant-only loss); eos
                             ``<|im_end|>``

``chat_template.jinja`` (a template for the plain demo tokenizer, ``data.chat_template``)
is written by hand, like the job specs.

The output is deterministic: a fixed seed drives every random choice, and the BPE
trainer is deterministic for a fixed input. Run from anywhere:

    python roundpipe/demo_data/make_demo_data.py [--out DIR]

``demo_job.yaml`` is written by hand (it carries comments); its ``vocab_size`` must equal
``VOCAB_SIZE``, which the tests check.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_VOCAB_SIZE",
    "NUM_CONVERSATIONS",
    "NUM_DOCUMENTS",
    "SEED",
    "VOCAB_SIZE",
    "generate_conversations",
    "generate_documents",
    "main",
    "make_chat_tokenizer",
    "train_tokenizer",
]

SEED = 20260101
NUM_DOCUMENTS = 1600
VOCAB_SIZE = 512
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
NUM_CONVERSATIONS = 400
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
CHAT_VOCAB_SIZE = VOCAB_SIZE + 2
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role not in ('system', 'user', 'assistant') %}"
    "{{- raise_exception('role ' ~ message.role ~ ' is not one of system, user, assistant') }}"
    "{%- endif %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message.content ~ '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' ~ message.role ~ '\\n' ~ message.content ~ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML-style: each turn is ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n``; the assistant's
content and its ``<|im_end|>`` are the generation (the trained tokens)."""

NUMBERS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
    "eighteen", "nineteen", "twenty",
]  # fmt: skip
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January", "February", "March", "April", "May", "June", "July", "August",
    "September", "October", "November", "December",
]  # fmt: skip
# Colour mixing as children learn it with paint; symmetric pairs are listed once.
MIXES = {
    ("red", "yellow"): "orange",
    ("blue", "yellow"): "green",
    ("red", "blue"): "purple",
    ("red", "white"): "pink",
    ("black", "white"): "grey",
}
COLOURS = ["red", "blue", "green", "yellow", "white", "black", "orange", "purple"]
THINGS = ["ball", "cup", "box", "hat", "book", "kite", "shoe", "chair"]
PLACES = ["on the table", "under the bed", "in the garden", "by the door", "near the window"]
ANIMALS = {  # name: (legs, sound)
    "cat": (4, "meow"),
    "dog": (4, "woof"),
    "cow": (4, "moo"),
    "duck": (2, "quack"),
    "hen": (2, "cluck"),
    "sheep": (4, "baa"),
}


def _cap(sentence: str) -> str:
    return sentence[0].upper() + sentence[1:]


def _counting(rng: random.Random) -> list[str]:
    start = rng.randrange(0, 15)
    length = rng.randrange(4, 7)
    run = NUMBERS[start : start + length]
    if rng.random() < 0.5:
        return [f"Counting up from {run[0]}: {', '.join(run)}."]
    return [f"Counting down from {run[-1]}: {', '.join(reversed(run))}."]


def _arithmetic(rng: random.Random) -> list[str]:
    out = []
    for _ in range(rng.randrange(2, 4)):
        a, b = rng.randrange(0, 11), rng.randrange(0, 11)
        if rng.random() < 0.6:
            out.append(_cap(f"{NUMBERS[a]} plus {NUMBERS[b]} is {NUMBERS[a + b]}."))
        else:
            hi, lo = max(a, b), min(a, b)
            out.append(_cap(f"{NUMBERS[hi]} minus {NUMBERS[lo]} is {NUMBERS[hi - lo]}."))
    return out


def _days(rng: random.Random) -> list[str]:
    out = []
    for _ in range(rng.randrange(2, 4)):
        i = rng.randrange(7)
        if rng.random() < 0.5:
            out.append(f"The day after {DAYS[i]} is {DAYS[(i + 1) % 7]}.")
        else:
            out.append(f"The day before {DAYS[i]} is {DAYS[(i - 1) % 7]}.")
    return out


def _months(rng: random.Random) -> list[str]:
    i = rng.randrange(12)
    return [
        f"After {MONTHS[i]} comes {MONTHS[(i + 1) % 12]}.",
        f"{MONTHS[i]} is month number {NUMBERS[i + 1]}.",
    ]


def _colours(rng: random.Random) -> list[str]:
    out = []
    for _ in range(rng.randrange(1, 3)):
        (a, b), c = rng.choice(list(MIXES.items()))
        if rng.random() < 0.5:
            a, b = b, a
        out.append(f"Mixing {a} and {b} gives {c}.")
    colour, thing, place = rng.choice(COLOURS), rng.choice(THINGS), rng.choice(PLACES)
    out.append(f"The {colour} {thing} is {place}.")
    return out


def _animals(rng: random.Random) -> list[str]:
    out = []
    for name in rng.sample(sorted(ANIMALS), rng.randrange(1, 3)):
        legs, sound = ANIMALS[name]
        article = "An" if name[0] in "aeiou" else "A"
        out.append(f"{article} {name} has {NUMBERS[legs]} legs.")
        out.append(f"The {name} says {sound}.")
    return out


TOPICS = [_counting, _arithmetic, _days, _months, _colours, _animals]


def _question(rng: random.Random) -> tuple[str, str]:
    """One (question, answer) pair about the corpus' facts."""
    kind = rng.randrange(6)
    if kind == 0:
        a, b = rng.randrange(0, 11), rng.randrange(0, 11)
        return f"What is {NUMBERS[a]} plus {NUMBERS[b]}?", _cap(
            f"{NUMBERS[a]} plus {NUMBERS[b]} is {NUMBERS[a + b]}."
        )
    if kind == 1:
        i = rng.randrange(7)
        return (
            f"What day comes after {DAYS[i]}?",
            f"The day after {DAYS[i]} is {DAYS[(i + 1) % 7]}.",
        )
    if kind == 2:
        i = rng.randrange(12)
        return f"What comes after {MONTHS[i]}?", f"After {MONTHS[i]} comes {MONTHS[(i + 1) % 12]}."
    if kind == 3:
        (a, b), c = rng.choice(list(MIXES.items()))
        return f"What do {a} and {b} make?", f"Mixing {a} and {b} gives {c}."
    name = rng.choice(sorted(ANIMALS))
    legs, sound = ANIMALS[name]
    if kind == 4:
        article = "An" if name[0] in "aeiou" else "A"
        return f"How many legs does a {name} have?", f"{article} {name} has {NUMBERS[legs]} legs."
    return f"What does the {name} say?", f"The {name} says {sound}."


def generate_conversations(
    num_conversations: int = NUM_CONVERSATIONS, seed: int = SEED
) -> list[list[dict[str, str]]]:
    """``num_conversations`` chats of one to three question/answer turns, a third of them
    opening with a system message; identical for identical arguments."""
    rng = random.Random(f"{seed}:chat")
    chats = []
    for _ in range(num_conversations):
        messages = []
        if rng.random() < 1 / 3:
            messages.append({"role": "system", "content": "You answer in one short sentence."})
        for _ in range(rng.randrange(1, 4)):
            question, answer = _question(rng)
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": answer})
        chats.append(messages)
    return chats


def generate_documents(num_documents: int = NUM_DOCUMENTS, seed: int = SEED) -> list[str]:
    """Return ``num_documents`` short paragraphs, identical for identical arguments."""
    rng = random.Random(seed)
    docs = []
    for _ in range(num_documents):
        sentences: list[str] = []
        for topic in rng.sample(TOPICS, rng.randrange(2, 4)):
            sentences.extend(s for s in topic(rng) if s)
        docs.append(" ".join(sentences))
    return docs


def train_tokenizer(docs: list[str], out_dir: Path, vocab_size: int = VOCAB_SIZE) -> None:
    """Train a byte-level BPE on ``docs`` and save it as a transformers tokenizer dir."""
    # Imported here so that reading this module (e.g. for its constants) costs nothing.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # Byte-level: every string round-trips, even text the demo corpus never saw.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"trained vocabulary has {tok.get_vocab_size()} entries, not {vocab_size}"
        )
    _save(tok, out_dir, eos_token=EOS_TOKEN)


def _save(tok: Any, out_dir: Path, **settings: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    # Written by hand rather than by transformers' save_pretrained so that the file does
    # not change with the transformers version, and names the class that both 4.x and
    # 5.x resolve (5.x maps it onto its tokenizers backend).
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": settings.pop("eos_token"),
        "pad_token": PAD_TOKEN,
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
        **settings,
    }
    with open(out_dir / "tokenizer_config.json", "w", encoding="utf-8", newline="\n") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def make_chat_tokenizer(tokenizer_dir: Path, out_dir: Path) -> None:
    """The demo BPE plus the two turn markers and ``CHAT_TEMPLATE``, in ``out_dir``."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in (TURN_START, TURN_END)])
    if tok.get_vocab_size() != CHAT_VOCAB_SIZE:
        raise RuntimeError(f"chat vocabulary has {tok.get_vocab_size()} entries")
    _save(tok, out_dir, eos_token=TURN_END, chat_template=CHAT_TEMPLATE)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args(argv)
    docs = generate_documents()
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "demo_corpus.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    train_tokenizer(docs, args.out / "tokenizer")
    chats = generate_conversations()
    with open(args.out / "demo_chat.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for messages in chats:
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    make_chat_tokenizer(args.out / "tokenizer", args.out / "chat_tokenizer")
    print(
        f"wrote {len(docs)} documents, a {VOCAB_SIZE}-token tokenizer, {len(chats)} "
        f"conversations and a {CHAT_VOCAB_SIZE}-token chat tokenizer to {args.out}"
    )


if __name__ == "__main__":
    main()

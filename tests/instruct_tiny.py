"""Instruction data for the tiny word models of `hf_tiny` (`import instruct_tiny` from any test
folder): a chat template over the word tokenizer, and JSONL sets of the three record shapes
whose answers follow from their prompts, so a few steps of training lower the eval loss.

The template marks turns with words the vocabulary lacks (they tokenize to [UNK]) and ends
each with `</s>` (EOS), as real templates end a turn with an end-of-turn token. `CONVERSATIONS`
are for the real models' tokenizers and templates.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}assistant {% endif %}")


def add_chat_template(model_folder: Path) -> None:
    (model_folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "eos_token": "</s>", "bos_token": "<s>"}))


def _pair(rng: random.Random) -> tuple[str, str]:
    # the answer is the prompt's words shifted by 40: learnable from the prompt alone
    words = [rng.randint(3, 40) for _ in range(rng.randint(2, 6))]
    return " ".join(f"w{w}" for w in words), " ".join(f"w{w + 40}" for w in words)


def record(shape: str, rng: random.Random) -> dict:
    q, a = _pair(rng)
    if shape == "messages":
        turns = [{"role": "system", "content": "w50"}] if rng.random() < 0.3 else []
        return {"messages": turns + [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
    if shape == "prompt":
        return {"prompt": q, "completion": a}
    return {"text": f"{q} {a}"}


def write_set(folder: Path, shape: str = "messages", n_train: int = 48, n_valid: int = 8, seed: int = 0) -> Path:
    """folder/train.jsonl and folder/valid.jsonl of `shape`; returns the folder."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", n_train), ("valid", n_valid)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(record(shape, rng)) + "\n" for _ in range(n)))
    return folder


# conversations for the real models' tokenizers and templates: system turns, several turns,
# newlines in an answer
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Name a primary color."},
     {"role": "assistant", "content": "Blue."}],
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Tell me a fact about cats."},
     {"role": "assistant", "content": "Cats sleep for most of the day."}],
    [{"role": "system", "content": "Be kind and brief."},
     {"role": "user", "content": "I feel tired."},
     {"role": "assistant", "content": "Rest a little, then drink some water."},
     {"role": "user", "content": "Thanks, any other idea?"},
     {"role": "assistant", "content": "A short walk outside helps too.\nTake care!"}],
    [{"role": "user", "content": "Write a haiku about rain."},
     {"role": "assistant", "content": "Soft rain on the roof,\nthe garden drinks slowly now,\nclouds drift far away."}],
]

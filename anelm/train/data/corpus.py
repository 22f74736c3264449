"""The built-in corpus: children's stories from a small probabilistic grammar.

`anelm train` with no `--data` trains on this, so the default run needs no download. Each
story keeps its cast (names, kinds, pronouns) and its object from the first sentence to the
last, so a model must carry context across sentences to predict well (that is what makes it
learnable but not trivial), while the word lists keep the vocabulary small enough for a tiny
model. The text is a pure function of (seed, size): Python's `random.Random` with a seed
draws the same sequence on every platform.
"""

from __future__ import annotations

import random
from pathlib import Path

# (name, pronoun, possessive); names and pronouns are chosen together so stories agree
NAMES = [("Lily", "she", "her"), ("Tom", "he", "his"), ("Mia", "she", "her"), ("Ben", "he", "his"),
         ("Sara", "she", "her"), ("Max", "he", "his"), ("Anna", "she", "her"), ("Sam", "he", "his"),
         ("Lucy", "she", "her"), ("Jack", "he", "his"), ("Emma", "she", "her"), ("Leo", "he", "his"),
         ("Zoe", "she", "her"), ("Tim", "he", "his"), ("Ella", "she", "her"), ("Finn", "he", "his"),
         ("Rosa", "she", "her"), ("Noah", "he", "his"), ("Ivy", "she", "her"), ("Kai", "he", "his")]
KINDS = ["girl", "boy", "bunny", "cat", "dog", "bear", "duck", "fox", "mouse", "frog", "bird",
         "puppy", "kitten", "owl", "pig", "lamb"]
SIZES = ["little", "small", "big", "tiny", "happy", "kind", "brave", "curious", "shy", "silly"]
PLACES = ["the park", "the forest", "a small house", "the garden", "the big farm", "the beach",
          "the town", "a green hill", "the river", "the old barn", "the school", "the meadow"]
OBJECTS = [("ball", "red"), ("kite", "blue"), ("box", "brown"), ("hat", "yellow"),
           ("cake", "sweet"), ("book", "old"), ("boat", "little"), ("flower", "pink"),
           ("key", "shiny"), ("drum", "loud"), ("cup", "green"), ("shell", "white"),
           ("stone", "round"), ("toy car", "fast"), ("blanket", "soft"), ("apple", "big")]
ACTIVITIES = ["play", "run", "sing", "jump", "draw", "dance", "read", "swim", "climb", "bake"]
PROBLEMS = ["was stuck in a tall tree", "fell into the water", "was lost under the leaves",
            "was broken in two", "was too high to reach", "was covered in mud",
            "rolled down the hill", "was taken by the wind"]
SAD = ["sad", "scared", "worried", "upset", "lonely", "angry"]
GLAD = ["happy", "proud", "glad", "excited", "thankful"]
FIXES = {  # what helps with each problem: (verb phrase, result)
    "was stuck in a tall tree": ("climbed up and got", "brought it down"),
    "fell into the water": ("used a long stick to pull out", "dried it in the sun"),
    "was lost under the leaves": ("looked and looked for", "found it at last"),
    "was broken in two": ("used some glue to fix", "made it like new"),
    "was too high to reach": ("stood on a chair to get", "held it tight"),
    "was covered in mud": ("washed", "made it clean again"),
    "rolled down the hill": ("ran after", "caught it at the bottom"),
    "was taken by the wind": ("chased", "caught it by the fence"),
}
LESSONS = ["that friends help each other", "to be kind to others", "to share with friends",
           "to never give up", "that it is good to ask for help", "to be careful"]
EOT = "<|endoftext|>"
SEPARATOR = f"\n{EOT}\n"
WHEN = ["One day", "One morning", "One sunny day", "After lunch", "One evening"]


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _kind(r: random.Random, he: str) -> str:
    # "girl" and "boy" must agree with the pronoun; animals take either
    k = r.choice(KINDS)
    if k in ("girl", "boy"):
        k = "girl" if he == "she" else "boy"
    return k


def _story(r: random.Random) -> str:
    """One story: opening, want, problem, helper, fix, ending; some sentences optional."""
    (name, he, his), (friend, fhe, _) = r.sample(NAMES, 2)
    kind, fkind = _kind(r, he), _kind(r, fhe)
    obj, color = r.choice(OBJECTS)
    place, problem = r.choice(PLACES), r.choice(list(FIXES))
    fix, result = FIXES[problem]
    size = _a(r.choice(SIZES))
    out = [r.choice([f"Once upon a time, there was {size} {kind} named {name}.",
                     f"There was once {size} {kind} called {name}.",
                     f"{name} was {size} {kind} who lived near {place}."])]
    out.append(f"{_cap(he)} loved to {r.choice(ACTIVITIES)} at {place}.")
    if r.random() < 0.7:
        out.append(f"{_cap(his)} favorite thing was {_a(color)} {obj}.")
    out.append(f"{r.choice(WHEN)}, {name} saw that the {obj} {problem}.")
    out.append(f"{name} felt very {r.choice(SAD)}.")
    if r.random() < 0.5:
        out.append(f'"Oh no, my {obj}!" {he} said.')
    out.append(f"Then {name}'s friend {friend} the {fkind} came by.")
    out.append(r.choice([f'"Do not be {r.choice(SAD)}, {name}. I will help you," said {friend}.',
                         f'"I can help you," said {friend}.',
                         f"{friend} wanted to help {name}."]))
    out.append(f"{friend} {fix} the {obj} and {result}.")
    out.append(f"{name} was so {r.choice(GLAD)}. \"Thank you, {friend}!\" {he} said.")
    if r.random() < 0.6:
        out.append(f"They played with the {obj} together until the sun went down.")
    out.append(r.choice([f"{name} learned {r.choice(LESSONS)}.", "The end.",
                         f"From that day on, {name} and {friend} were best friends."]))
    return " ".join(out)


def generate_corpus(n_bytes: int = 400_000, seed: int = 0) -> str:
    """Stories separated by `EOT` lines (TinyStories' text format), stopping at the first
    story past `n_bytes`. The trained BPE keeps EOT as one special id, so a model learns to
    end a story and generation can stop there."""
    r = random.Random(seed)
    stories, size = [], 0
    while size < n_bytes:
        s = _story(r)
        stories.append(s)
        size += len(s) + len(SEPARATOR)
    return SEPARATOR.join(stories) + "\n"


def write_corpus(path: str | Path, n_bytes: int = 400_000, seed: int = 0) -> Path:
    """Write `generate_corpus` to `path` (UTF-8) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(generate_corpus(n_bytes, seed), encoding="utf-8")
    return path

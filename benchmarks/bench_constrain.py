"""Constrained-decoding libraries for `response_format` (docs/serving.md) on SmolLM2's tokenizer.

`anelm serve` masks, at each step, the tokens that cannot continue a valid JSON output. Three
libraries do that from a JSON schema; each is timed here on the real SmolLM2-135M-Instruct
tokenizer (49,152 ids, byte-level BPE) read from ../shared's GGUF:

    import     `import LIB` in a fresh interpreter (a server pays it once, at its first request)
    setup      the tokenizer-level object, built once per tokenizer
    schema     compiling a small schema (a string, an integer and an enum field) after setup
    object     compiling `{"type": "object"}`, what `json_object` asks for
    mask       ms per token of the library's bitmask alone, over a ~100-token output replayed
               through a fresh matcher, best of --repeat (schema's output | object's output)
    1st step   ms per token of the whole step in the first replay, as a request meets it: the
               bitmask, the -inf logits made from it, and the token fed back
    size       installed MB of the library, and of what it pulls in beyond anelm's own
               dependencies (what `pip install 'anelm[serve]'` would add)

Measured on the 2-core Linux machine (--repeat 5) with llguidance 1.9.1, xgrammar 0.2.9 and
outlines-core 0.2.14; the output replays are 92 (schema) and 118 (object) tokens:

    library        import  setup  schema  object  mask ms/tok     1st step ms/tok  installed
    llguidance      0.04s  0.20s   0.8ms   0.6ms  0.004 | 0.008   0.06 | 0.05      7.8 MB, no deps
    xgrammar        1.67s  0.03s   4.2ms   3.6ms  0.006 | 0.006   0.05 | 0.05      3.4 MB + 819 MB
    outlines-core   0.00s  0.17s    24ms    5.7s  0.050 | 0.037   0.09 | 0.08      5.4 MB, no deps

xgrammar's 819 MB are torch (the CPU build here; pip's default on Linux brings CUDA's libraries
too), transformers and tvm-ffi, plus triton on Linux x86-64 (a 286 MB wheel, not installed here).

The choice is llguidance:
- json_object is "any JSON object", a recursive grammar. outlines-core compiles JSON schemas to
  one regular expression, so its "object" is a depth-limited regex that takes ~6 s to index for
  this vocabulary, on every json_object request, and still rejects objects nested
  more than 3 deep.
- xgrammar imports torch and transformers at import (~2 s) and requires them, with triton on
  Linux x86-64, as install dependencies: about a gigabyte for a feature whose work is a few
  hundred kilobytes of masks. anelm keeps torch optional (the `distributed` and test extras).
- llguidance has no dependencies, imports in tens of milliseconds, compiles a request's schema
  in under a millisecond (the per-request cost; its tokenizer setup is paid once per model),
  and its per-token mask cost is far below a decode step of even the smallest model here. It
  reads an HF `tokenizers` JSON directly (our `HFTokenizer`), without transformers.
- Kept well: llguidance (guidance-ai, from Microsoft; MIT) releases every few weeks (1.9.1 in
  2026-09) and is a structured-output backend of vLLM, SGLang and llama.cpp.
  xgrammar (MLC, Apache-2.0) is as active; outlines-core (dottxt, Apache-2.0) last released in
  2026-01. All three are among PyPI's 2,000 most downloaded packages. Per-token mask costs
  differ by tens of microseconds, nothing next to a decode step; compile time, dependencies and
  json_object decide.

    python benchmarks/bench_constrain.py [--repeat 5]

A library that is not installed prints as such (try `pip install --target DIR LIB` and
PYTHONPATH=DIR to measure one without adding it to the environment).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

GGUF = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "smollm2-135m-instruct-q4_1.gguf"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "color"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "color": {"enum": ["red", "green", "blue"]}}}
OBJECT = {"type": "object"}
SCHEMA_TEXT = json.dumps({
    "name": "Ada Lovelace, who wrote the first published program for Charles Babbage's proposed "
            "Analytical Engine in 1843, a table of steps that computes the Bernoulli numbers, and "
            "who saw that such a machine could act on symbols other than numbers, such as music, "
            "if the relations of pitched sounds were expressed in its notation; she died in London",
    "age": 36, "color": "green"})
OBJECT_TEXT = json.dumps({
    "title": "Notes on the Analytical Engine", "year": 1843, "translated": True, "pages": 65,
    "authors": [{"name": "Luigi Menabrea", "role": "author"}, {"name": "Ada Lovelace", "role": "translator"}],
    "notes": ["A", "B", "C", "D", "E", "F", "G"], "price": None, "rating": 4.5, "tags": ["computing", "history"]})


class Llguidance:
    module, dist = "llguidance", "llguidance"

    def setup(self, hf, vocab, eos):
        import llguidance

        return llguidance.LLTokenizer(hf.to_str(), eos_token=eos)

    def compile(self, tok, schema):
        import llguidance

        opts = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=opts))
        assert not m.is_error(), m.get_error()
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bitmask):
        m.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)

    def advance(self, m, token):
        return m.consume_token(token)


class Xgrammar:
    module, dist = "xgrammar", "xgrammar"

    def setup(self, hf, vocab, eos):
        import xgrammar

        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=len(vocab), stop_token_ids=[eos])
        return xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, compiler, schema):
        return compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))

    def matcher(self, compiled):
        import xgrammar

        return xgrammar.GrammarMatcher(compiled)

    def fill(self, m, bitmask):
        m.fill_next_token_bitmask(bitmask[None])

    def advance(self, m, token):
        return m.accept_token(token)


class OutlinesCore:
    module, dist = "outlines_core", "outlines-core"

    def setup(self, hf, vocab, eos):
        import outlines_core

        byte_of = gpt2_byte_decoder()
        special = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        tokens: dict[bytes, list[int]] = {}
        for i, t in enumerate(vocab):
            if i not in special:
                tokens.setdefault(bytes(byte_of[c] for c in t), []).append(i)
        return outlines_core.Vocabulary(eos, tokens)

    def compile(self, vocabulary, schema):
        import outlines_core

        return outlines_core.Index(outlines_core.json_schema.build_regex_from_schema(json.dumps(schema)), vocabulary)

    def matcher(self, index):
        import outlines_core

        return outlines_core.Guide(index)

    def fill(self, m, bitmask):
        m.write_mask_into(bitmask.ctypes.data, bitmask.size, 4)

    def advance(self, m, token):
        m.advance(token, return_tokens=False)
        return True


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character of each byte, reversed."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + i): b for i, b in enumerate(extra)}}


def import_seconds(module: str) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout)


def installed_mb(dist: str) -> tuple[float, float, list[str]]:
    """(MB of the distribution, MB of the dependencies it adds beyond anelm's, the names of those
    required but not installed here)."""
    from packaging.requirements import Requirement

    def closure(name: str, seen: dict[str, md.Distribution | None]) -> None:
        key = name.lower().replace("_", "-")
        if key in seen:
            return
        try:
            seen[key] = d = md.distribution(name)
        except md.PackageNotFoundError:
            seen[key] = None
            return
        for r in map(Requirement, d.requires or []):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                closure(r.name, seen)

    ours: dict[str, md.Distribution | None] = {}
    closure("anelm", ours)
    theirs: dict[str, md.Distribution | None] = {}
    closure(dist, theirs)
    mb = {k: sum(f.size or 0 for f in d.files or []) / 1e6 for k, d in theirs.items() if d is not None}
    own = mb.pop(dist.lower(), 0.0)
    added = sum(v for k, v in mb.items() if k not in ours)
    return own, added, sorted(k for k, d in theirs.items() if d is None)


def replay(lib, compiled, ids: list[int], vocab_size: int, repeat: int) -> tuple[float, float]:
    """(best seconds per token of the bitmask alone, of a whole step in the first replay, as a
    request meets it: bitmask, -inf logits, advance)."""
    bitmask = np.zeros((vocab_size + 31) // 32, np.int32)
    logits = np.random.default_rng(0).standard_normal(vocab_size).astype(np.float32)
    best_mask, first_step = float("inf"), None
    for _ in range(repeat):
        m, mask_t, step_t = lib.matcher(compiled), 0.0, 0.0
        for token in ids:
            t0 = time.perf_counter()
            lib.fill(m, bitmask)
            t1 = time.perf_counter()
            allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)
            masked = np.where(allowed, logits, -np.inf)
            ok = allowed[token] and lib.advance(m, token)
            step_t += time.perf_counter() - t0
            mask_t += t1 - t0
            if not ok:
                raise RuntimeError(f"token {token} rejected ({masked.size} logits)")
        best_mask = min(best_mask, mask_t / len(ids))
        first_step = step_t / len(ids) if first_step is None else first_step
    return best_mask, first_step


def measure(lib, hf, vocab: list[str], eos: int, repeat: int) -> dict[str, str]:
    row = {"import": f"{import_seconds(lib.module):.2f}s"}
    importlib.import_module(lib.module)
    t = time.perf_counter()
    tok = lib.setup(hf, vocab, eos)
    row["setup"] = f"{time.perf_counter() - t:.2f}s"
    masks, steps = [], []
    for name, schema, text in (("schema", SCHEMA, SCHEMA_TEXT), ("object", OBJECT, OBJECT_TEXT)):
        t = time.perf_counter()
        compiled = lib.compile(tok, schema)
        row[name] = f"{(time.perf_counter() - t) * 1e3:.1f}ms"
        ids = hf.encode(text, add_special_tokens=False).ids
        try:
            mask, step = replay(lib, compiled, ids, len(vocab), repeat)
            masks.append(f"{mask * 1e3:.3f}")
            steps.append(f"{step * 1e3:.2f}")
        except RuntimeError as e:
            masks.append("rejects")
            steps.append(str(e).split(" (")[0])
        row[f"tokens {name}"] = str(len(ids))
    row["mask ms/tok"] = " | ".join(masks)
    row["1st step ms/tok"] = " | ".join(steps)
    own, added, missing = installed_mb(lib.dist)
    row["size"] = f"{own:.1f} MB + {added:.0f} MB deps" + (f" + {', '.join(missing)} (absent here)" if missing else "")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=5, help="replays of each output; the best is kept (default 5)")
    args = p.parse_args()
    from tokenizers import Tokenizer

    from anelm.models.loading import load_model

    tok = load_model(GGUF)[2]
    hf = Tokenizer.from_str(tok.tok.to_str())
    vocab = [t for t, _ in sorted(hf.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])]
    print(f"SmolLM2 tokenizer: {len(vocab)} ids, EOS {tok.eos_id}; mask/step columns: schema | object output")
    cols = ["import", "setup", "schema", "object", "tokens schema", "tokens object", "mask ms/tok", "1st step ms/tok", "size"]
    print(f"{'library':<14}" + "".join(f"{c:>16}" for c in cols[:-1]) + "  size")
    for lib in (Llguidance(), Xgrammar(), OutlinesCore()):
        try:
            md.distribution(lib.dist)
        except md.PackageNotFoundError:
            print(f"{lib.dist:<14}  not installed")
            continue
        row = measure(lib, hf, vocab, tok.eos_id, args.repeat)
        print(f"{lib.dist:<14}" + "".join(f"{row[c]:>16}" for c in cols[:-1]) + f"  {row['size']}", flush=True)


if __name__ == "__main__":
    main()

"""Generation speed: the device pipeline on the emulator against HF `transformers` on the CPU.

A GPT-2-124M-shaped model (12 layers, 768 wide, 12 heads, vocabulary 50257, context 1024;
random weights) is built with `transformers` from a config and saved with `save_pretrained` to
a temporary folder; both sides load that folder. Measured in the same run on the same machine:

- prefill: prompt in, first token's logits out (ms), prompt of --prompt tokens;
- decode: greedy tokens per second over --tokens tokens after the first;

for anelm (`build_runner(..., "emulator")`, kernels compiled before timing: compiles are a
one-off per process, reported apart) and for HF `generate` (greedy, `use_cache=True`, the same
prompt and token count; one warm-up run first). The two take turns, round by round, and the
best round of each counts: other processes on the machine slow both alike. Ratios are HF time / anelm time (prefill) and
anelm rate / HF rate (decode): above 1 means anelm is faster.

Threads: numpy's BLAS and torch get the same count, --threads (default 1), set before either
library loads (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, MKL_NUM_THREADS, torch.set_num_threads).

    python benchmarks/bench_generate.py [--prompt 32] [--tokens 64] [--threads 1] [--repeat 3]

With `--model PATH` (an HF folder or a .gguf file) both sides load that real model instead, the
prompt is the first --prompt tokens of ../shared/data/text/apache-2.0.txt (or --text FILE), and
the load times (file to ready model: dequantizing a GGUF, HF's conversion) are printed too:

    python benchmarks/bench_generate.py --model ../shared/data/models/smollm2-135m-instruct-q4_1.gguf

With `--processes`, the figures are those a user sees: every round runs `anelm generate --json
--device emulator` in a new process (its `prefill_ms` and `decode_tokens_per_s`, which include
whatever compiling happens inside them) and HF's greedy `generate` in another new process (load,
then one generation; a streamer stamps the first token and the last), the two in turns, and each
process's peak RSS is read from the kernel when it exits (`wait4`, in a small launcher that forks
it: a child forked from this process would start from this process's peak), with its wall time from start
to exit (imports and loading included: what a user waits for in all). The GPT-2 shape gets a
tokenizer (GPT-2's vocabulary rebuilt from ../shared/data/tokenizers/gpt2-merges.txt) so that
`anelm generate` can read the folder; both sides get the same prompt ids.

    python benchmarks/bench_generate.py --processes [--model PATH]

With `--gemma3` the model is Gemma 3 270M (Q4_K_M GGUF, vocabulary 262,144; `gemma3.py`),
assembled into anelm's cache folder (`models/`) on first use; both modes take it:

    python benchmarks/bench_generate.py --gemma3 [--processes]

`--serve`: a server's first token, per prompt of --lengths tokens of the text, each in a new
process that loads as `anelm serve --max-context N` (`load_engine`) and builds every program
(`DeviceRunner.warm`): cold (its first request), then warm (best of --repeat more):

    python benchmarks/bench_generate.py --serve --model PATH [--max-context 512] [--lengths 37,300]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt", type=int, default=32, help="prompt length in tokens (default 32)")
    p.add_argument("--tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--threads", type=int, default=1, help="BLAS/torch threads, both sides (default 1)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per side; the best is kept (default 3)")
    p.add_argument("--layers", type=int, default=12, help="decoder layers (default 12, GPT-2 124M)")
    p.add_argument("--model", help="a real model (HF folder or .gguf) for both sides instead of the GPT-2 shape")
    p.add_argument("--gemma3", action="store_true",
                   help="Gemma 3 270M (Q4_K_M GGUF, assembled into anelm's cache folder) as --model")
    p.add_argument("--text", help="prompt text (default: ../shared/data/text/apache-2.0.txt)")
    p.add_argument("--processes", action="store_true",
                   help="each round a new `anelm generate` process and a new HF process (figures as a user sees them)")
    p.add_argument("--hf-child", nargs=2, metavar=("MODEL", "IDS"), help=argparse.SUPPRESS)  # one HF round
    p.add_argument("--serve", action="store_true", help="a server's first token (cold and warm) per --lengths")
    p.add_argument("--max-context", type=int, default=512, help="--serve: the server's context (default 512)")
    p.add_argument("--lengths", default="37,300", help="--serve: prompt lengths in tokens (default 37,300)")
    p.add_argument("--serve-child", type=int, help=argparse.SUPPRESS)  # one --serve process
    return p.parse_args()


def set_threads(n: int) -> None:
    # must run before numpy/torch load: their thread pools read these once
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)


def make_model(folder: str, layers: int):
    import torch
    import transformers

    cfg = transformers.GPT2Config(n_layer=layers)  # the 124M shape: 768 wide, 12 heads, 50257 tokens
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(folder)
    return model


def hf_side(model, prompt: list[int], tokens: int):
    """One HF round: (prefill s, decode s for tokens-1 steps) of greedy `generate`."""
    import torch

    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, use_cache=True, pad_token_id=0)

    def run(n: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        return time.perf_counter() - t

    first = run(1)  # prompt in, one token out
    return first, run(tokens) - first


def anelm_side(folder: str, positions: int):
    """The emulator runner for the saved model (nothing compiled yet) and its tokenizer, its
    programs sized for `positions` (prompt + new tokens) as `anelm generate` sizes them."""
    from anelm.device.emulator import Emulator
    from anelm.generate.device_plan import generation_context
    from anelm.generate.pipeline import build_runner
    from anelm.models.loading import load_model

    config, weights, tok = load_model(folder)
    return build_runner(config, weights, Emulator(), generation_context(positions)), tok


def hf_real(path: str):
    """HF transformers' float32 model of an HF folder or a .gguf file."""
    from pathlib import Path

    import torch
    import transformers

    p = Path(path)
    kw = dict(gguf_file=p.name) if p.suffix == ".gguf" else {}
    folder = str(p.parent if p.suffix == ".gguf" else p)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()


def greedy(runner, prompt: list[int], tokens: int) -> tuple[float, float]:
    """One anelm round: (prefill s, decode s for tokens-1 steps) of greedy generation."""
    import numpy as np

    cache = runner.new_cache()
    t0 = time.perf_counter()
    token = int(np.argmax(runner.prefill(prompt, cache, last_only=True)[-1]))
    t1 = time.perf_counter()
    for _ in range(tokens - 1):
        token = int(np.argmax(runner.decode(token, cache)))
    return t1 - t0, time.perf_counter() - t1


def rounds(sides: dict, repeat: int) -> dict[str, tuple[float, float]]:
    """Best (prefill s, decode s) per side over `repeat` rounds, the sides taking turns so that
    a machine whose load changes over the run slows both alike."""
    best = {name: (float("inf"), float("inf")) for name in sides}
    for _ in range(repeat):
        for name, run in sides.items():
            p, d = run()
            best[name] = (min(best[name][0], p), min(best[name][1], d))
    return best


SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def text_of(args, path: bool = False):
    """The prompt text (--text, default ../shared/data/text/apache-2.0.txt), or its path."""
    file = Path(args.text) if args.text else SHARED / "text" / "apache-2.0.txt"
    return file if path else file.read_text(encoding="utf-8")


def gpt2_tokenizer(folder: Path) -> None:
    """vocab.json + merges.txt for GPT-2's ids: the 256 byte symbols in code order, then one
    token per merge (GPT-2 numbers merge i's result 256 + i), then <|endoftext|>."""
    import shutil

    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    symbols = sorted([chr(b) for b in keep] + [chr(256 + i) for i in range(256 - len(keep))])
    merges = SHARED / "tokenizers" / "gpt2-merges.txt"
    vocab = {sym: i for i, sym in enumerate(symbols)}
    for line in merges.read_text(encoding="utf-8").splitlines()[1:]:
        if line:
            vocab.setdefault(line.replace(" ", ""), len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    shutil.copy(merges, folder / "merges.txt")


# A child's peak RSS (ru_maxrss) starts at the RSS of the process it was forked from: a command
# started straight from this one (hundreds of MiB after building the model) reported this
# process's peak, the same figure for both sides. So a small launcher forks and execs the
# command and reports the rusage it reads when the command exits (`wait4`), and its wall time.
LAUNCHER = """import os, sys, time
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{usage.ru_maxrss} {time.perf_counter() - t0} {os.waitstatus_to_exitcode(status)}")
"""


def child(cmd: list[str]) -> tuple[dict, float, float]:
    """Run cmd in a new process: (its last stdout line as JSON, its peak RSS in MiB, its wall
    time from start to exit in s: imports, loading and everything a user waits for)."""
    import subprocess

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, \
            tempfile.NamedTemporaryFile("r") as report:
        subprocess.run([sys.executable, "-c", LAUNCHER, report.name, *cmd], stdout=out, stderr=err, text=True)
        rss_kib, wall, code = report.read().split()
        out.seek(0), err.seek(0)
        if int(code):
            raise SystemExit(f"{' '.join(cmd[:4])} ... failed:\n{err.read()[-2000:]}")
        return json.loads(out.read().strip().splitlines()[-1]), int(rss_kib) / 1024, float(wall)  # KiB -> MiB


def hf_child(model: str, ids: str, tokens: int, threads: int) -> int:
    """One HF round in this process: load, generate greedily, print prefill_ms and the rate."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(threads)
    m = hf_real(model)
    stamps: list[float] = []

    class Stamps(BaseStreamer):
        def put(self, value):
            stamps.append(time.perf_counter())

        def end(self):
            pass

    prompt = torch.tensor([json.loads(ids)])
    t0 = time.perf_counter()
    with torch.no_grad():
        m.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, use_cache=True,
                   pad_token_id=0, streamer=Stamps())
    first, last = stamps[1], stamps[-1]  # stamps[0]: the prompt itself
    print(json.dumps({"prefill_ms": (first - t0) * 1e3, "decode_tokens_per_s": (len(stamps) - 2) / (last - first)}))
    return 0


def processes(args) -> int:
    """The --processes benchmark (module doc)."""
    from anelm.models.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory(prefix="anelm-bench-") as tmp:
        if args.model:
            path, what = args.model, (f"Gemma 3 270M, {args.model}" if args.gemma3 else args.model)
            tok = load_tokenizer(path) if Path(path).is_dir() else None
            if tok is None:
                from anelm.models.loading import load_model
                tok = load_model(path)[2]
        else:
            make_model(tmp, args.layers)
            gpt2_tokenizer(Path(tmp))
            path, what = tmp, f"GPT-2 shape: {args.layers} layers, 768 wide, vocabulary 50257"
            tok = load_tokenizer(tmp)
        ids = tok.encode(text_of(args))[:args.prompt]
        prompt = tok.decode(ids)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        os.environ.update(env)
        anelm = [sys.executable, "-m", "anelm", "generate", "--model", path, "--prompt", prompt, "--json",
                 "--max-tokens", str(args.tokens), "--temperature", "0", "--device", "emulator"]
        hf = [sys.executable, __file__, "--threads", str(args.threads), "--tokens", str(args.tokens),
              "--hf-child", path, json.dumps(ids)]
        best = {"anelm": [float("inf"), 0.0, 0.0, float("inf")], "hf": [float("inf"), 0.0, 0.0, float("inf")]}
        seen: dict[str, list] = {"anelm": [], "hf": []}
        for _ in range(args.repeat):
            for name, cmd in (("hf", hf), ("anelm", anelm)):
                got, rss, wall = child(cmd)
                b = best[name]
                best[name] = [min(b[0], got["prefill_ms"]), max(b[1], got["decode_tokens_per_s"]), max(b[2], rss),
                              min(b[3], wall)]
                seen[name].append((round(got["prefill_ms"]), round(got["decode_tokens_per_s"], 2)))
                if name == "anelm":
                    n_prompt, n_out = len(got["prompt_ids"]), len(got["ids"])
    (a_p, a_r, a_m, a_w), (h_p, h_r, h_m, h_w) = best["anelm"], best["hf"]
    print(f"{what}; prompt {n_prompt} tokens ({len(ids)} for HF), anelm generated {n_out}, HF {args.tokens}; "
          f"{args.threads} thread(s) each; best of {args.repeat} rounds, each side a new process per round")
    print(f"anelm generate (emulator): prefill {a_p:.0f} ms, decode {a_r:.2f} tokens/s, peak RSS {a_m:.0f} MiB "
          f"(rounds: {seen['anelm']})")
    print(f"HF transformers {_hf_version()} (CPU): prefill {h_p:.0f} ms, decode {h_r:.2f} tokens/s, "
          f"peak RSS {h_m:.0f} MiB (rounds: {seen['hf']})")
    print(f"ratio: prefill {h_p / a_p:.2f}x HF's speed, decode {a_r / h_r:.2f}x HF's rate, "
          f"peak RSS {a_m / h_m:.2f}x HF's")
    print(f"whole process (start to exit: imports, loading, prefill, decode): anelm {a_w:.2f} s, HF {h_w:.2f} s "
          f"({h_w / a_w:.2f}x HF's speed)")
    return 0


def serve_child(args) -> int:
    """One --serve process: load and warm as `anelm serve`, then a --serve-child-token prompt's first token."""
    from anelm.generate.engine import load_engine

    t = time.perf_counter()
    engine = load_engine(args.model, device="emulator", max_context=args.max_context, notice=lambda _: None)
    r, load_s, t = engine.runner, time.perf_counter() - t, time.perf_counter()
    built, warm_s, firsts = r.warm(), time.perf_counter() - t, []
    ids = engine.tokenizer.encode(text_of(args))[:args.serve_child]
    for _ in range(1 + args.repeat):
        t = time.perf_counter()
        next(iter(engine.stream(ids, engine.options(max_tokens=2, temperature=0.0))))
        firsts.append((time.perf_counter() - t) * 1e3)
    bucket = getattr(r, "prefill_bucket", r.plan.bucket)(len(ids))  # (a runner from before the prefill policy)
    print(json.dumps({"tokens": len(ids), "load_s": load_s, "warm_s": warm_s, "programs": built, "bucket": bucket,
                      "slots": getattr(r, "buckets", r.plan.prefill), "cold": firsts[0], "warm": min(firsts[1:])}))
    return 0


def serve(args) -> int:
    """The --serve benchmark (module doc)."""
    if not args.model:
        raise SystemExit("--serve needs --model")
    os.environ["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    print(f"{args.model}, --max-context {args.max_context}, emulator, {args.threads} thread(s): first token, ms")
    for n in args.lengths.split(","):
        g, _, _ = child([sys.executable, __file__, "--model", args.model, "--threads", str(args.threads), "--repeat",
                         str(args.repeat), "--max-context", str(args.max_context), "--text", str(text_of(args, True)),
                         "--serve-child", n])
        print(f"  {g['tokens']} tokens: cold {g['cold']:.0f}, warm {g['warm']:.0f} (bucket {g['bucket']}, slots "
              f"{g['slots']}; loaded in {g['load_s']:.1f} s, {g['programs']} programs ready in {g['warm_s']:.1f} s)")
    return 0


def _hf_version() -> str:
    import transformers

    return transformers.__version__


def main() -> int:
    args = parse_args()
    set_threads(args.threads)
    if args.hf_child:
        return hf_child(*args.hf_child, args.tokens, args.threads)
    if args.gemma3:
        from gemma3 import gemma3_gguf  # benchmarks/gemma3.py, beside this script

        args.model = str(gemma3_gguf())
    if args.serve_child:
        return serve_child(args)
    if args.serve:
        return serve(args)
    if args.processes:
        return processes(args)
    import numpy as np
    import torch

    from anelm.device.base import compile_count

    torch.set_num_threads(args.threads)
    if args.model:
        t = time.perf_counter()
        runner, tok = anelm_side(args.model, args.prompt + args.tokens)
        load_ours = time.perf_counter() - t
        t = time.perf_counter()
        model = hf_real(args.model)
        load_hf = time.perf_counter() - t
        prompt = tok.encode(text_of(args))[:args.prompt]
        what = f"{args.model}: {runner.config.num_hidden_layers} layers, {runner.config.hidden_size} wide"
        if args.gemma3:
            what = f"Gemma 3 270M, {what}, vocabulary {runner.config.vocab_size}"
    else:
        prompt = np.random.default_rng(0).integers(0, 50257, args.prompt).tolist()
        with tempfile.TemporaryDirectory(prefix="anelm-bench-") as folder:
            model = make_model(folder, args.layers)
            runner, _ = anelm_side(folder, args.prompt + args.tokens)
        what = f"GPT-2 shape: {args.layers} layers, 768 wide, vocabulary 50257"
    hf_side(model, prompt, 2)  # warm-up: first-call allocations and dispatch caches
    t, before = time.perf_counter(), compile_count()
    greedy(runner, prompt, args.tokens)  # compiles the prompt's bucket and the decode tiers it reaches
    compile_s, compiles = time.perf_counter() - t, compile_count() - before
    best = rounds({"hf": lambda: hf_side(model, prompt, args.tokens),
                   "anelm": lambda: greedy(runner, prompt, args.tokens)}, args.repeat)
    (hf_p, hf_d), (a_p, a_d) = best["hf"], best["anelm"]
    hf_rate, a_rate = (args.tokens - 1) / hf_d, (args.tokens - 1) / a_d
    used = ", ".join(f"{kind} {size}" for kind, size in sorted({(k, s) for k, _, s in runner.kernels}))
    print(f"{what}; prompt {len(prompt)} tokens, "
          f"{args.tokens} generated; {args.threads} thread(s) for numpy BLAS and torch; best of {args.repeat}")
    print(f"anelm (emulator): prefill {a_p * 1e3:.0f} ms, decode {a_rate:.2f} tokens/s "
          f"({compiles} compiles in {compile_s:.1f} s before timing; programs per layer: {used})")
    print(f"HF transformers {sys.modules['transformers'].__version__} (CPU): prefill {hf_p * 1e3:.0f} ms, "
          f"decode {hf_rate:.2f} tokens/s")
    if args.model:
        print(f"load (file to a ready model): anelm {load_ours:.1f} s (incl. the stream calibration), "
              f"HF {load_hf:.1f} s")
    print(f"ratio: prefill {hf_p / a_p:.2f}x HF's speed, decode {a_rate / hf_rate:.2f}x HF's rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())

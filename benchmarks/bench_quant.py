"""Decode rate and memory on the emulator: the unquantized model against its W8 and W8A8 folders.

    python benchmarks/bench_quant.py MODEL W8_DIR W8A8_DIR [--tokens 32]

Each model runs in its own process (so its peak resident memory is its own): a 16-token
prompt, then greedy decode. Printed per model: decode tokens/s and the process's peak RSS
(the emulator holds fp16 weights as float32 arrays, int8 ones as int8, per compiled program).
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import numpy as np
from anelm.generate.pipeline import build_runner
from anelm.models.loading import load_model
config, weights, tok = load_model(sys.argv[1])
runner = build_runner(config, weights, "emulator", max_context=64)
cache = runner.new_cache()
logits = runner.prefill(tok.encode("The license grants you the right to")[:16], cache, last_only=True)[-1]
tok_id = int(logits.argmax())
runner.decode(tok_id, cache)  # compiles the decode programs
n = int(sys.argv[2])
t = time.perf_counter()
for _ in range(n):
    tok_id = int(runner.decode(tok_id, cache).argmax())
rate = n / (time.perf_counter() - t)
print(json.dumps({"decode_tokens_per_s": rate,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def measure(model: str, tokens: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(tokens)], capture_output=True, text=True,
                         check=True, env=None)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    args = sys.argv[1:]
    tokens = 32
    if "--tokens" in args:
        i = args.index("--tokens")
        tokens = int(args[i + 1])
        del args[i:i + 2]
    names = ["fp16", "w8", "w8a8"]
    rows = {n: measure(m, tokens) for n, m in zip(names, args)}
    print("| model | decode tokens/s | peak RSS |")
    print("|---|---|---|")
    for n, r in rows.items():
        print(f"| {n} | {r['decode_tokens_per_s']:.2f} | {r['peak_rss_mib']:.0f} MiB |")


if __name__ == "__main__":
    main()

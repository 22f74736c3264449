"""Size is enforced (STYLE.md §6, tinygrad's sz.py): small modules, and a budget for the package.

Lines are counted as in the files (docstrings and comments included), so the budget is honest.
"""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "anelm"
MAX_MODULE_LINES = 400
# 20000 until this round; grown by what each capability needed: LoRA (issue 14: adapters, the
# LoRA and GPT-2 training steps, finetune), the kernel cache and the MIL fast reader (issue 18),
# column-separable evaluation and the reject table (issue 13), the reference static programs (16);
# then the fp16-resident decode (18), LoRA dropout (14), Orion's and maderix's first programs (16),
# the cold compile's one-pass fp16 fold and one-match statements, the program store that lets a
# warm generation skip building its programs, decode's bound one-column steps (18), the kernel cache's
# entries that keep what the build derived, the remembered source fingerprint and the kernel
# cache's count that spares a listing per put, the fold into blob payloads, the CPU's own fp16
# conversions both ways, the parser's one-match statement, the ordered graph's skipped sort and
MAX_PACKAGE_LINES = 24345


def line_counts() -> dict[str, int]:
    return {str(p.relative_to(PACKAGE)): len(p.read_text(encoding="utf-8").splitlines())
            for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_is_small():
    big = {name: n for name, n in line_counts().items() if n > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split them): {big}"


def test_package_stays_within_its_line_budget():
    total = sum(line_counts().values())
    assert total <= MAX_PACKAGE_LINES, f"anelm/ has {total} lines; budget {MAX_PACKAGE_LINES}"

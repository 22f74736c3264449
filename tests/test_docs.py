"""README.md and docs/ stand on their own: they cite behaviours and docs/ pages, never documents
the repository does not hold (the project's internal contracts and fact sheets, issue numbers),
README.md stays a README (at most 250 lines), and every relative link resolves to a file, and
its #anchor to a heading of that file."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "facts" / "README.md"]
FORBIDDEN = [r"CONTRACTS", r"peer-facts", r"maderix-ane-facts", r"orion-facts", r"STYLE\.md",
             r"\bissues? #?\d+", r"§\s*\d"]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def citations(text: str) -> list[str]:
    return [m.group(0) for p in FORBIDDEN for m in re.finditer(p, text, re.I)]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.is_file():
            out.append(f"{path.relative_to(root)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{path.relative_to(root)}: {target} (no such heading)")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_citation_of_documents_outside_the_repository(page):
    assert citations(page.read_text(encoding="utf-8")) == []


def test_the_check_sees_a_citation():
    assert citations("as CONTRACTS §2.7 says (issue 12; peer-facts §4.9)") == ["CONTRACTS", "peer-facts",
                                                                              "issue 12", "§2", "§4"]
    assert citations("Orion #9, 115 compiles, PR #23") == []


def test_the_readme_is_at_most_250_lines():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


def test_every_relative_link_resolves():
    assert [b for page in PAGES for b in broken_links(page)] == []


def test_the_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[a](page.md#title) [b](missing.md) [c](page.md#nowhere) [d](https://x.org/y)\n")
    assert [b.split(": ", 1)[1] for b in broken_links(page, tmp_path)] == [
        "missing.md (no such file)", "page.md#nowhere (no such heading)"]


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    """Source paths a page names in backticks (`anelm/x/y.py`, `device/emulator/__init__.py`,
    `tests/...`, `benchmarks/...`) that are neither under the repository's root nor under anelm/."""
    names = re.findall(r"`((?:[a-z0-9_]+/)+[a-z0-9_]+\.(?:py|json|lark))`", text)
    return [n for n in names if not ((root / n).exists() or (root / "anelm" / n).exists())]


def test_every_source_path_named_exists():
    assert [f"{p.relative_to(ROOT)}: {n}" for p in PAGES for n in missing_paths(p.read_text(encoding="utf-8"))] == []
    assert missing_paths("`device/emulator/__init__.py` `anelm/nowhere.py` `tests/test_docs.py`") == ["anelm/nowhere.py"]

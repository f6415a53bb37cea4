"""The README stays a user's guide: short, every figure linked to the benchmark file that measured
it, and every link in README, docs/ and benchmarks/ pointing at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]


def test_readme_is_a_guide_not_a_diary():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert not re.search(r"\b20\d\d-[01]\d-[0-3]\d\b", readme.split("## Results")[0]), \
        "dated measurements belong in benchmarks/, not in the guide"


def test_every_result_links_to_its_benchmark_file():
    readme = (ROOT / "README.md").read_text()
    table = [line for line in readme.split("## Results", 1)[1].split("\n## ", 1)[0].splitlines()
             if line.startswith("| ") and not line.startswith("| result") and "---" not in line]
    assert table
    for row in table:
        for cell in row.strip("|").split("|")[1:]:
            if re.search(r"\d", cell):
                link = r"\[[^\]]+\]\[\w+\]"
                assert re.fullmatch(rf"\s*{link}(,\s*{link})*\s*", cell), f"an unlinked figure: {cell!r}"
    for ref, target in re.findall(r"^\[(\w+)\]: (\S+)$", readme, re.M):
        assert (ROOT / target).is_file() and target.startswith("benchmarks/"), (ref, target)


def test_links_resolve():
    missing = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target and not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not missing, "\n".join(missing)


def test_benchmark_files_are_named_by_date_machine_and_topic():
    names = [p.name for p in (ROOT / "benchmarks").glob("*.md") if p.name != "README.md"]
    assert names
    bad = [n for n in names if not re.fullmatch(r"20\d\d-[01]\d(-[0-3]\d)?_[a-z0-9-]+_[a-z0-9.-]+\.md", n)]
    assert not bad, bad

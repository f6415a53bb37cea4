"""Project structure rules: imports flow one way (model <- runtime <- export, all <- pipeline).

export may use runtime so that it verifies graphs exactly as the runtime serves them (how ONNX
Runtime runs int8 graphs depends on the CPU: runtime/cpu_int8.py); runtime never imports export."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "export", "runtime", "pipeline")
ALLOWED = {
    "model": {"model"},
    "export": {"model", "runtime", "export"},
    "runtime": {"model", "runtime"},
    "pipeline": set(PACKAGES),
}


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & set(PACKAGES)


def test_imports_flow_one_way():
    bad = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            extra = imported_packages(path) - ALLOWED[pkg]
            if extra:
                bad.append(f"{path.relative_to(ROOT)} imports {sorted(extra)}")
    assert not bad, "\n".join(bad)


def test_model_knows_nothing_of_onnx():
    for path in (ROOT / "model").rglob("*.py"):
        text = path.read_text()
        assert "import onnx" not in text and "onnxruntime" not in text, path


def _module_imports() -> dict[str, set[str]]:
    """Each of our modules -> ours it imports anywhere in it (lazy imports in functions included; the
    annotation-only ones under `if TYPE_CHECKING:` excepted)."""
    modules = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        found = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_no_import_cycle():
    """No two of our modules import each other, however lazily (a cycle over one constant, like the loader's
    and the torch backend's over DEFAULT_TOPK, is a module in the wrong place)."""
    graph, state, stack, cycles = _module_imports(), {}, [], []

    def visit(module: str) -> None:
        state[module] = "open"
        stack.append(module)
        for other in sorted(graph[module]):
            if state.get(other) == "open" and not module.startswith(other + "."):  # a package's own __init__
                cycles.append(" -> ".join(stack[stack.index(other):] + [other]))
            elif other not in state:
                visit(other)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "\n".join(cycles)


def _layout_block(lines: list[str], head: str, indent: int) -> str:
    """The text of docs/layout.md's tree entry that starts `head` at `indent` spaces: its line and the lines
    after it up to the next entry at that indent or less."""
    for i, line in enumerate(lines):
        if line.startswith(" " * indent + head) and not line[indent - 1:indent].strip():
            block = [line[indent + len(head):]]
            for following in lines[i + 1:]:
                if len(following) - len(following.lstrip()) <= indent and following.strip():
                    break
                block.append(following)
            return "\n".join(block)
    return ""


def test_layout_doc_names_every_module():
    """docs/layout.md names every module of ours in its package's entry (a file of a package by its name,
    a module of a pipeline/ subpackage by its stem in that subpackage's entry; a command module by its
    command), so a new one comes with the line that says what it is for."""
    import re

    lines = (ROOT / "docs" / "layout.md").read_text().splitlines()
    unnamed = []
    for pkg in PACKAGES:
        package = _layout_block(lines, f"{pkg}/", 4)
        for p in sorted((ROOT / pkg).rglob("*.py")):
            if p.stem in ("__init__", "__main__") or p.parent.name == "commands":
                continue
            inner = p.relative_to(ROOT / pkg).parts
            if len(inner) == 1:  # a module of the package itself: its file name in the package's entry
                named = re.search(rf"(?<![\w/]){re.escape(p.name)}\b", package)
            else:  # pipeline/serve/app.py: "app" in the entry of serve/
                entry = _layout_block(package.splitlines(), f"{inner[0]}/", 6)
                named = bool(entry) and re.search(rf"\b{re.escape(p.stem)}\b", entry)
            if not named:
                unnamed.append(str(p.relative_to(ROOT)))
    assert not unnamed, f"docs/layout.md does not name: {', '.join(unnamed)}"


# The calls that read a model dir's manifest, tokenizer, shortlist table or references from disk.
DIR_READS = {"read_manifest", "tokenizer_from_file", "Tokenizer.from_file", "VocabTokenizer.from_file",
             "Shortlist.load", "references.read"}
# The files that may make them: ModelDir (runtime/model_dir.py), the one way into a model dir, and the readers'
# own modules.
DIR_READERS = {"runtime/model_dir.py", "runtime/tokenizer.py", "runtime/shortlist.py", "runtime/references.py"}


def _dir_reads(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in DIR_READS:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}(")
    return found


def test_product_code_reads_a_model_dir_through_model_dir_only():
    """Outside model/ and export/ (which write model dirs), a manifest, tokenizer, shortlist or references file
    is read through runtime/model_dir.py's ModelDir (verified once, one error per fault), nowhere else."""
    reads = [r for pkg in ("runtime", "pipeline") for p in sorted((ROOT / pkg).rglob("*.py"))
             if str(p.relative_to(ROOT)) not in DIR_READERS for r in _dir_reads(p)]
    assert not reads, "read a model dir through runtime.model_dir.ModelDir instead:\n" + "\n".join(reads)
    assert _dir_reads(ROOT / "runtime" / "model_dir.py"), "the test no longer sees ModelDir's own reads"

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

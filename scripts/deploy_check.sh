#!/usr/bin/env bash
# The deploy path without PyTorch, as a user deploys: a model dir exported here (with torch), then
# a fresh virtualenv with only `pip install -e ".[deploy]"` serves it and gates it against the
# references recorded at export (tests/test_deploy.py, which fails if anything imports torch).
#
#   bash scripts/deploy_check.sh [WORK_DIR]     # default: a temporary directory, removed at the end
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-$(mktemp -d)}
[ -n "${1:-}" ] || trap 'rm -rf "$work"' EXIT
mkdir -p "$work"
python - "$work" <<'PY'
import sys
from pathlib import Path
work = Path(sys.argv[1])
words = ["ab", "cd", "ef", "gh", "ij", "kl"]
src = [f"{w} {w}{i} x{i}" for i, w in enumerate(words * 3)]
(work / "held_out.src").write_text("".join(s + "\n" for s in src))
(work / "held_out.tgt").write_text("".join(s.upper() + "\n" for s in src))
# a parallel corpus for the vocabulary shortlist (serve-batch/parity --shortlist without torch)
import random
rng = random.Random(0)
vocab = ["".join(rng.choices("abcdefghijklmnop", k=rng.randint(2, 6))) for _ in range(80)]
pairs = [rng.sample(range(80), 4) for _ in range(300)]
(work / "corpus.src").write_text("".join(" ".join(vocab[i] for i in p) + "\n" for p in pairs))
(work / "corpus.tgt").write_text("".join(" ".join(vocab[(i + 7) % 80] for i in reversed(p)) + "\n" for p in pairs))
PY
pipeline random-checkpoint "$work/random.pt" --preset tiny --vocab-size 120 --force
pipeline export "$work/random.pt" --out "$work/model" --force --no-tensorrt --max-src-len 32 --max-tgt-len 40 \
    --reference-src "$work/held_out.src" --reference-tgt "$work/held_out.tgt" \
    --shortlist-src "$work/corpus.src" --shortlist-tgt "$work/corpus.tgt"
python -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q -e ".[deploy]" pytest
echo "deploy install: $(du -sm "$work/venv/lib" | cut -f1) MB in the venv's lib/ (pip and setuptools included)"
if "$work/venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "torch is installed in the deploy venv: .[deploy] must not depend on it" >&2
    exit 1
fi
PIPELINE_DEPLOY_MODEL_DIR="$work/model" "$work/venv/bin/python" -m pytest -q --noconftest -p no:cacheprovider \
    tests/test_deploy.py

"""docs/scale-out.md's "Your own Ray job" snippet, run as written on a local Ray cluster of two CPUs (only its
paths pointed at this test's files): it hung before (the actor pool held every CPU; the read task waited for
one for ever)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
pq = pytest.importorskip("pyarrow.parquet")
import pyarrow as pa  # noqa: E402
from helpers import cli_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def snippet() -> str:
    text = (ROOT / "docs" / "scale-out.md").read_text()
    section = text[text.index("## Your own Ray job"):]
    block = re.search(r"\n((?:    .*\n|\n)+)", section).group(1)
    return "\n".join(line[4:] for line in block.splitlines())


@pytest.mark.slow
def test_the_docs_ray_job_runs_as_written(fp32_dir, tmp_path):
    code = snippet()
    assert "read_shards(" in code and "ActorPoolStrategy(size=cores)" in code
    corpus, out = tmp_path / "corpus", tmp_path / "translated"
    corpus.mkdir()
    rows = [f"der hund sieht die katze {i}" for i in range(40)]
    pq.write_table(pa.table({"text": rows[:25]}), corpus / "part-0.parquet")
    (corpus / "part-1.txt").write_text("".join(f"{r}\n" for r in rows[25:]))
    code = (code.replace("/shared/corpus/", str(corpus)).replace("/shared/translated/", str(out))
            .replace("/shared/models/en-de", str(fp32_dir)).replace("ray.init()", "ray.init(num_cpus=2)"))
    script = tmp_path / "job.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], env=cli_env(), cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)  # it waited without end before
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = pa.concat_tables([pq.read_table(p) for p in sorted(out.glob("*.parquet"))])
    got = {(Path(p).name, line): text for p, line, text in zip(table.column("path").to_pylist(),
                                                               table.column("line").to_pylist(),
                                                               table.column("translation").to_pylist())}
    assert sorted(got) == [("part-0.parquet", i) for i in range(1, 26)] + [("part-1.txt", i) for i in range(1, 16)]
    assert all(isinstance(t, str) and t for t in got.values())

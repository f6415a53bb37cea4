"""Issue 59's profiled walks, kept: the layer above the runtime stays thin. scripts/profile_walks.py counts, with
sys.setprofile, the functions of ours that run for one LibreTranslate request and one Ray Data batch; the surface
(pipeline/) has at most so many named functions in so many files, and the runtime never calls back up into
serve (a climb). Counts of code that runs, not times."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_hf_read_once import profile_walks


def _surface(walk: dict[str, Any]) -> tuple[int, int, int]:
    return walk["pipeline_named"], walk["pipeline_files"], walk["climbs"]


def test_a_libretranslate_request_runs_a_thin_surface(fp32_dir: Path) -> None:
    pytest.importorskip("starlette")
    walk = profile_walks().libre_walk(fp32_dir)
    named, files, climbs = _surface(walk)
    assert named <= 60 and files <= 10 and climbs == 0, walk["function_list"]


def test_a_ray_batch_reaches_the_runtime_in_a_few_calls(fp32_dir: Path) -> None:
    pytest.importorskip("numpy")
    walk = profile_walks().ray_walk(fp32_dir)
    named, files, climbs = _surface(walk)
    assert named <= 8 and files <= 3 and climbs == 0, walk["function_list"]

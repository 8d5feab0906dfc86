"""Smoke tests of the benchmark suite: modules, statistics, scale-model arithmetic, report.

No benchmark is run here (they spawn ranks and take minutes); these take seconds.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import statistics
import sys
from pathlib import Path

import pytest
from repo_packages import register_package

register_package("benchmarks")
register_package("tools")

from benchmarks import run as suite  # noqa: E402
from benchmarks._common import markdown_table, paired_ratio, result, stats  # noqa: E402
from benchmarks.model_shapes import ParamShape  # noqa: E402
from tools.scale_model import (  # noqa: E402
    _fsdp2_shard,
    _moved,
    _plan_counts,
    _torchao_state_bytes,
    muon_ns_flops,
)
from vefsdp_optim.sharding import RaggedShard  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


def test_the_suite_runs_every_bench_and_holds_only_the_suite():
    """run.py runs every ``bench_*`` module, each with a title; besides them the folder
    holds only the suite's shared pieces (tools and reproductions live in tools/)."""
    benches = {p.stem for p in BENCH_DIR.glob("bench_*.py")}
    assert set(suite.BENCHMARKS.values()) == benches
    assert set(suite.TITLES) == set(suite.BENCHMARKS)
    others = {p.name for p in BENCH_DIR.iterdir() if p.is_file() and not p.stem.startswith("bench_")}
    assert others <= {"__init__.py", "_common.py", "_memtrack.py", "model_shapes.py", "run.py", "REPORT.md"}, others


@pytest.mark.parametrize("module", sorted(set(suite.BENCHMARKS.values())))
def test_every_bench_module_has_run_and_main(module):
    if importlib.util.find_spec(f"benchmarks.{module}") is None:
        pytest.skip(f"benchmarks/{module}.py is not in this checkout (the report says so)")
    mod = importlib.import_module(f"benchmarks.{module}")
    assert callable(mod.main)
    sig = inspect.signature(mod.run)
    assert list(sig.parameters) == ["quick"] and sig.parameters["quick"].default is True


def test_stats_and_paired_ratio_against_statistics():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    s = stats(xs, scale=10)
    assert s == {"median": 30.0, "p25": 20.0, "p75": 40.0, "n": 5}
    r = paired_ratio([2.0, 3.0, 8.0], [1.0, 2.0, 4.0])  # ratios 2, 1.5, 2
    assert r["median"] == statistics.median([2.0, 1.5, 2.0]) and r["p25"] == 1.75
    with pytest.raises(ValueError, match="equal"):
        paired_ratio([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="at least one"):
        stats([])


def test_scale_model_counts_by_hand():
    # NS on a 4 x 6 matrix, one iteration: X X^T 2*4*4*6, G G 2*4^3, (.) X 2*4*4*6
    assert muon_ns_flops((4, 6), steps=1) == 2 * 96 + 128 + 2 * 96
    assert muon_ns_flops((6, 4), steps=5) == 5 * (2 * 96 + 128 + 2 * 96)  # tall: same sides
    # FSDP2 Shard(0) at S = 4: 10 rows padded to 12, 3 per rank
    assert _fsdp2_shard(ParamShape("w", (10, 3), True), 4) == 9
    # 30 elements cut at 15 vs at 12: elements 12..14 change rank
    a = RaggedShard.from_boundaries([0, 15, 30])
    b = RaggedShard.from_boundaries([0, 12, 30])
    assert _moved(a, b) == 3 and _moved(a, a) == 0
    # torchao rule: 8-bit only for >= 4096 elements and a multiple of 256
    assert _torchao_state_bytes(4096) == 4096 * 2 + 16 * 2 * 4
    assert _torchao_state_bytes(4000) == 4000 * 8
    # a tiny group on S = 2: FSDP2 pads 10 rows to 10 (no pad) and 5 to 6
    counts = _plan_counts([[ParamShape("a", (10, 3), True), ParamShape("b", (5,), False)]], 2)
    assert counts["numel"] == 35
    assert counts["FSDP2"] == {"m": 15 + 3, "padding": 1}
    for opt in ("AdamW", "AdamW8bit", "Shampoo", "Muon"):
        m, pad = counts[opt]["m"], counts[opt]["padding"]
        assert m % 16 == 0 and pad == 2 * m - 35 and m >= 18


def test_report_renders_a_tiny_result():
    ok = result("tiny", [{"world": 2, "ours_ms": stats([1.0, 2.0, 3.0]), "ratio": 0.5}],
                ["a note"], headline=[{"comparison": "ours / peer", "ratio": stats([0.5])}],
                extra_table=[{"k": "v"}])
    suite_result = {
        "mode": "quick", "wall_s": 12.0,
        "machine": {"cpu": "cpu", "cores": 2, "ram_gib": 1.0, "torch": "x", "python": "3",
                    "cuda_devices": [], "date_utc": "today"},
        "results": {
            "tiny": ok,
            "gone": {"name": "gone", "rows": [], "notes": [], "status": "not available: missing"},
            "cuda": result("cuda", [{"device": "cuda", "world": 2, "status": "not run: no CUDA device"}], []),
        },
    }
    json.dumps(suite_result)  # JSON-able
    md = suite.render_report(suite_result)
    assert "# Benchmark report" in md and "--quick" in md
    assert "| world | ours_ms | ratio |" in md and "| 2 | 2 (1.5–2.5) | 0.5 |" in md
    assert "## Headline ratios" in md and "ours / peer" in md
    assert "**extra_table**" in md and "| v |" in md
    assert "- a note" in md
    assert "**not available: missing**" in md
    assert "not run: no CUDA device" in md and "CPU only" in md


def test_markdown_table_blank_cells_and_escaping():
    md = markdown_table([{"a": 1}, {"b": "x|y"}])
    assert md.splitlines()[2] == "| 1 |  |" and md.splitlines()[3] == "|  | x\\|y |"


def test_muon_sweep_grid_and_summary():
    from benchmarks import bench_muon_sweep as sweep

    grid = sweep.full_grid()
    assert len(grid) == len(set(grid)) == 142
    assert set(sweep.QUICK) <= set(grid)
    assert {c.family for c in sweep.QUICK} == set(sweep.FAMILIES) and {c.world for c in sweep.QUICK} == {2, 4}
    for c in grid:  # split blocks tile the rows; FSDP2 and Dion need rows divisible by W
        if (split := c.split_sizes()) is not None:
            assert all(sum(split) == s[0] and s[0] % c.world == 0 for s in c.shapes())
        assert sweep.Case.parse(c.spec()) == c
    assert sweep.Case.parse("gqa:128:2:2").blocks() == [(128, 128), (32, 128), (32, 128)] * 2
    assert [c.spec() for c in sweep.select("experts:512:*:4")] == [f"experts:512:{e}:4" for e in (4, 8, 16)]
    with pytest.raises(ValueError, match="no case"):
        sweep.select("nothing:*")
    with pytest.raises(ValueError, match="family"):
        sweep.Case("round", 64, 2, 2)
    rows = [{"shape": s, "W": 2, "r": {"median": m}} for s, m in (("a", 0.5), ("b", 2.0), ("c", 1.0))]
    s = sweep.summarize(rows, "r")
    assert s["geomean"] == 1.0 and s["worst"] == 2.0 and s["above_1"] == 1 and s["worst_shapes"].startswith("b W=2")


def test_one_dion_loader(tmp_path, monkeypatch):
    """The benches find Dion through ``_common``'s loader alone: a checkout lacking a
    module they need reads as not installed, and the package imports from the checkout."""
    from benchmarks import (
        _common,
        bench_muon_dion,
        bench_muon_moe,
        bench_muon_sweep,
        bench_normuon_dion,
    )

    pkg = tmp_path / "dion"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("MARK = 'fake dion'\n")
    (pkg / "muon.py").write_text("")
    monkeypatch.setenv(_common.DION_ENV, str(tmp_path))
    assert _common.dion_src() == str(tmp_path) and _common.dion_src("muon", "normuon") is None
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "dion", raising=False)
    assert _common.import_dion(str(tmp_path)).MARK == "fake dion"
    with pytest.raises(ValueError, match="dion/__init__.py"):
        _common.import_dion(str(tmp_path / "elsewhere"))
    monkeypatch.delenv(_common.DION_ENV)
    assert _common.dion_src() is None
    for mod in (bench_muon_dion, bench_muon_sweep, bench_normuon_dion, bench_muon_moe):
        assert not hasattr(mod, "DION_ENV") or mod.DION_ENV is _common.DION_ENV
        assert "sys.path" not in inspect.getsource(mod), mod.__name__


def test_a_render_keeps_the_marked_sections(tmp_path):
    """Re-rendering REPORT.md keeps the GPU check's section and the README's figures,
    and drops everything else of the earlier report."""
    suite_result = {"mode": "quick", "wall_s": 1.0,
                    "machine": {"cpu": "cpu", "cores": 2, "ram_gib": 1.0, "torch": "x", "python": "3",
                                "cuda_devices": [], "date_utc": "today"},
                    "results": {"tiny": result("tiny", [{"world": 2}], [])}}
    (tmp_path / "results.json").write_text(json.dumps(suite_result))
    report = tmp_path / "REPORT.md"
    gpu = "<!-- gpu-check: begin -->\n## GPU\nkept gpu\n<!-- gpu-check: end -->"
    figures = "<!-- figures: begin -->\n## Figures\nkept figures\n<!-- figures: end -->"
    report.write_text(f"# old\nstale line\n\n{gpu}\n\n{figures}\n")
    for _ in range(2):  # a second render keeps them once
        suite.main(["--render-only", "--out", str(tmp_path), "--report", str(report)])
        text = report.read_text()
        assert "stale line" not in text and "# Benchmark report" in text
        assert text.count("kept gpu") == 1 and text.count("kept figures") == 1
        assert text.index("kept figures") < text.index("kept gpu")


def test_muon_sweep_ns_batch_rows():
    """``--ns-batch``: each case's same-shape blocks once, timed batched against the loop."""
    from benchmarks import bench_muon_sweep as sweep

    cases = [sweep.Case.parse(s) for s in ("gqa:32:2:2", "gqa:32:2:4", "experts:16:2:2")]
    assert sweep._ns_classes(cases) == [(2, 32, 32), (4, 8, 32), (2, 32, 16), (2, 16, 32)]
    res = sweep.ns_batch(cases[:1], quick=True)
    assert [r["blocks"] for r in res["rows"]] == ["2 x 32x32", "4 x 8x32"]
    assert res["rows"][1]["ns_probe_batches"] is False  # 8 rows: below the guard
    assert all(r["ns_ratio"] > 0 and isinstance(r["ns_bits_equal"], bool) for r in res["rows"])
    assert any("geometric mean" in n for n in res["notes"])

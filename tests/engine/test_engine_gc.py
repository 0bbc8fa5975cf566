"""benchmarks/engine_gc.py's measurement, run for a few steps (no timing asserts): the numbers
come from inside the engine-core process and the table prints."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_gc.py"


@pytest.fixture(scope="module")
def engine_gc():
    spec = importlib.util.spec_from_file_location("engine_gc", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules["engine_gc"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["engine_gc"]


def test_gc_measurement_runs(engine_gc, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = engine_gc.build_model(tmp_path / "model", max_len=512)
    report = engine_gc.measure(model, num_requests=4, num_steps=5)
    assert report.num_requests == 4 and report.steps >= 5
    assert min(report.gen0, report.gen1, report.gen2) >= 0 and report.steps_per_s > 0
    # net tracked allocations: gc's gen-0 count also goes down as tracked objects are freed, so a
    # window in which requests finish can come out below zero
    assert math.isfinite(report.allocs_per_step)
    engine_gc.print_table([report])
    assert "gc allocs/step" in capsys.readouterr().out


def test_window_report_arithmetic(engine_gc) -> None:
    before = {"num_steps": 10, "gc_collections": [5, 1, 0], "gc_count": [100, 0, 0], "gc_threshold": [700, 10, 10]}
    after = {"num_steps": 20, "gc_collections": [8, 2, 0], "gc_count": [50, 0, 0], "gc_threshold": [700, 10, 10]}
    report = engine_gc.window_report(64, before, after, elapsed_s=2.0)
    assert (report.steps, report.gen0, report.gen1, report.gen2) == (10, 3, 1, 0)
    assert report.allocs_per_step == pytest.approx((4 * 701 - 50) / 10)
    assert report.steps_per_s == pytest.approx(5.0)

"""The reference results docs/performance.md quotes stay readable by `bench.run --report` as the
bench changes (a report of an older result must not need fields added since)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.run import format_report

REFERENCE = sorted((Path(__file__).parent.parent / "bench/results/reference").glob("*.json"))


@pytest.mark.parametrize("path", REFERENCE, ids=[p.name for p in REFERENCE])
def test_every_reference_result_reports(path: Path) -> None:
    text = format_report(json.loads(path.read_text()))
    assert "Targets" in text and "agent CPU per span" in text

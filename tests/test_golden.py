"""Golden program text: the printed rank programs of a fixed set of cases must not change.

A refactor that claims no behaviour change must leave every file under ``tests/golden/``
unchanged. The files are written with ``FXPAR_SHARING=0`` (every layer traced); the test prints
with the default (each repeated block traced once and stitched, ``fxpar.blocks``), so each case
also proves that sharing changes no byte of any rank's program, ledger or memory. An intended
change regenerates them (``make golden``) and shows up in review as a diff of the programs and
ledgers. The cases live in ``tests/golden/golden_cases.py``.
"""

from __future__ import annotations

import difflib
import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))
from golden_cases import CASES, GOLDEN_DIR, REGEN_COMMAND, Case, render_module  # noqa: E402

from fxpar.blocks import find_blocks  # noqa: E402


@pytest.fixture(autouse=True)
def _share_two_layer_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cases have 2-4 layers: share blocks repeated twice (the default only shares 4 or more)."""
    monkeypatch.setenv("FXPAR_SHARE_MIN", "2")

MAX_DIFF_LINES = 80


def trimmed_diff(expected: str, actual: str, name: str, limit: int = MAX_DIFF_LINES) -> str:
    """A unified diff of golden vs actual text, cut to ``limit`` lines with a count of the rest."""
    diff = list(difflib.unified_diff(expected.splitlines(), actual.splitlines(), f"golden/{name}",
                                     f"printed/{name}", lineterm=""))
    changed = sum(1 for d in diff if d[:1] in "+-" and d[:3] not in ("+++", "---"))
    head = diff[:limit]
    if len(diff) > limit:
        head.append(f"... {len(diff) - limit} more diff lines")
    return f"{changed} lines changed\n" + "\n".join(head)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_golden_program(case: Case, caplog: pytest.LogCaptureFixture) -> None:
    """The printed program and ledger of ``case`` equal its checked-in golden file."""
    caplog.set_level(logging.INFO, logger="torch.__trace")  # keep torch's trace records out of a failure report
    if not case.path.exists():
        pytest.fail(f"missing golden file {case.path.name}; create it with: {REGEN_COMMAND}")
    expected, (actual, pm) = case.path.read_text(), render_module(case)
    repeated = bool(find_blocks(case.build()[0]))
    captures = [p.notes["captures"] for p in pm._compiled.stages]
    assert all(c.whole is not repeated for c in captures), f"blocks shared: {repeated} expected, got {captures}"
    if actual != expected:
        pytest.fail(f"printed program differs from tests/golden/{case.path.name}; if the change is intended, "
                    f"regenerate with: {REGEN_COMMAND}\n{trimmed_diff(expected, actual, case.path.name)}",
                    pytrace=False)


def test_no_stale_golden_files() -> None:
    """Every ``.txt`` under ``tests/golden/`` belongs to a case (regenerating removes the others)."""
    extra = sorted(p.name for p in GOLDEN_DIR.glob("*.txt") if p.name not in {c.path.name for c in CASES})
    assert not extra, f"golden files without a case: {extra}; remove them with: {REGEN_COMMAND}"

"""Regenerate the golden program texts: ``make golden`` (or ``.venv/bin/python tests/golden/regen.py``).

Writes ``tests/golden/<case>.txt`` for every case in ``golden_cases.CASES`` and deletes golden
files of cases that no longer exist. ``--out DIR`` writes into another folder instead (to check
that printing is deterministic across processes: run twice, diff the folders); ``--check``
writes nothing and exits 1 if any golden file is stale.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from golden_cases import CASES, GOLDEN_DIR, render


def main(argv: list[str] | None = None) -> int:
    """Render every case; write (or with ``--check`` compare) the golden files. Returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=GOLDEN_DIR, help="folder to write into (default: tests/golden)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a golden file differs")
    args = ap.parse_args(argv)
    # the golden texts are the whole-model captures (every layer traced); tests/test_golden.py checks that
    # tracing each repeated block once (the default) prints them byte for byte
    os.environ["FXPAR_SHARING"] = "0"
    args.out.mkdir(parents=True, exist_ok=True)
    stale = []
    for case in CASES:
        path = args.out / case.path.name
        text = render(case)
        same = path.exists() and path.read_text() == text
        if not same:
            stale.append(path.name)
        if not args.check and not same:
            path.write_text(text)
        print(f"{'ok     ' if same else 'stale  ' if args.check else 'wrote  '}{path}")
    extra = sorted(p for p in args.out.glob("*.txt") if p.name not in {c.path.name for c in CASES})
    for path in extra:
        stale.append(path.name)
        print(f"{'extra  ' if args.check else 'removed'}{path}")
        if not args.check:
            path.unlink()
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())

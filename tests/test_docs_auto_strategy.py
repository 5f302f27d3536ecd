"""docs/concepts/auto-strategy.md starts with what a newcomer needs — what is measured, the
current numbers (those of bench/results/auto_strategy.json) and how to re-run — and leaves
the measurement history to auto-strategy-history.md."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "concepts" / "auto-strategy.md"
HISTORY = ROOT / "docs" / "concepts" / "auto-strategy-history.md"
RESULTS = ROOT / "bench" / "results" / "auto_strategy.json"


def _sections(text: str) -> list[str]:
    return re.findall(r"^## (.+)$", text, flags=re.M)


def test_the_page_opens_with_what_is_measured_the_numbers_and_how_to_rerun():
    sections = _sections(PAGE.read_text())
    assert sections[:4] == ["What is measured", "How it chooses", "Current numbers",
                            "How to re-run"]


def test_the_numbers_table_is_the_benchmarks_current_targets():
    text = PAGE.read_text()
    targets = json.loads(RESULTS.read_text())["targets"]
    rows = {cells[0]: cells for line in text.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}
    for t in targets:
        cells = rows.get(t["target"])
        assert cells is not None, f"no row for {t['target']!r}"
        assert cells[1] == t["goal"]
        assert float(cells[2]) == round(t["value"], 3), t["target"]
        assert cells[3] == {True: "yes", False: "**no**", None: "–"}[t["met"]]
    commits = {c["commit"] for c in json.loads(RESULTS.read_text())["cases"].values()}
    assert all(c in text for c in commits)  # says which run the numbers are from


def test_history_lives_in_its_own_page():
    text = PAGE.read_text()
    assert len(text.splitlines()) <= 160
    # commit hashes name past runs: only the results' own commit appears here
    commits = {c["commit"] for c in json.loads(RESULTS.read_text())["cases"].values()}
    named = set(re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7}\b", text))
    assert named <= commits, named - commits
    assert "auto-strategy-history.md" in text and HISTORY.is_file()
    history = HISTORY.read_text()
    for section in ("## 1. Calibration", "## 3. Detected sparsity in the runtime",
                    "## Default", "## Limits"):
        assert section in history

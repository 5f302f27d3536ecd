"""The cluster-service tutorial and its example job files agree with the code (no Ray)."""

from __future__ import annotations

import re
from pathlib import Path

from stratagem.service.scheduler import status_table

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "tutorials" / "cluster-service.md"


def test_each_example_job_file_names_itself():
    for path in sorted((ROOT / "examples" / "cluster").glob("*.yaml")):
        first = path.read_text().splitlines()[0]
        assert first.startswith(f"# stratagem submit examples/cluster/{path.name} "), path


def _blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)


def test_the_tutorials_ls_samples_have_the_tables_columns():
    header = status_table([], {}, ROOT).splitlines()[0]
    samples = [b for b in _blocks(TUTORIAL.read_text()) if b.startswith("JOB ")]
    assert len(samples) >= 2
    for block in samples:
        lines = block.splitlines()
        assert lines[0] == header
        for row in lines[1:]:  # as many values as columns, aligned to them
            assert len(row.split()) == len(header.split()), row
            assert len(row) == len(header), row


def test_the_second_job_is_submitted_once_the_first_runs():
    text = TUTORIAL.read_text()
    a, b = text.index("submit examples/cluster/job-a.yaml"), \
        text.index("submit examples/cluster/job-b.yaml")
    wait = text.find("until stratagem ls", a)
    assert a < wait < b  # not a fixed sleep that a slow or fast machine outruns


def test_the_tutorials_addresses_agree():
    text = TUTORIAL.read_text()
    up = re.search(r"cluster up: Ray at (\S+),", text)
    status = re.search(r"^Ray at (\S+);", text, flags=re.M)
    assert up and status and up.group(1) == status.group(1)

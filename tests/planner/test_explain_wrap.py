"""Issue 49: ``ad.explain()`` cut its lines at 80 columns with ``~`` and lost their ends
("chained all~", "exposed communicatio~", a layer's parameter name). Lines are wrapped,
never cut: everything that was to be said is there."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from stratagem.cli.plan import load_model
from stratagem.planner import Auto, choose, explain_json, explain_text
from stratagem.planner.explain import WIDTH, chunks
from stratagem.planner.probe import LinkProbe
from stratagem.resource import ResourceSpec

MODELS = Path(__file__).resolve().parents[2] / "examples" / "models.py"


def test_chunks_rejoin_to_the_text_within_the_width() -> None:
    name = "encoder.layers.15.self_attn.out_proj.weight"
    parts = chunks(name, 30)
    assert all(len(p) <= 30 for p in parts) and "".join(parts) == name
    assert parts[0].endswith(".")  # broken at a dot, not inside a word
    words = "exposed communication +12.5 ms, 3.1 vs 0.4 MB sent"
    assert " ".join(chunks(words, 24)) == words
    assert chunks("x" * 65, 30) == ["x" * 30, "x" * 30, "x" * 5]


def test_explanation_wraps_long_names_and_probe_lines_without_losing_them() -> None:
    model = load_model(f"{MODELS}:TinyLM")
    choice = choose(model, ResourceSpec.local(2), options=Auto())
    probe = LinkProbe(world=2, collective_s=4.2e-4, bus_bps=1.1e9, message_s=3.3e-4,
                      seconds=0.75, nominal_bps=1.25e9, all_to_all_s=5.5e-4,
                      group_fixed_s=4.4e-4, pull_round_s=6.1e-4, pull_round_one_s=7.7e-4,
                      interference=0.31, link_bps=0.9e9)
    text = explain_text(replace(choice, link_probe=probe))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= WIDTH
    assert "~" not in text
    flat = re.sub(r"\s+", " ", text)
    # The probe's fixed costs, whole (this line ran past 80 columns and was cut).
    assert ("fixed costs: collective 420 us (a group's 440 us), message 330 us, chained "
            "all-to-all 550 us") in flat
    assert "with one owner" in flat and "loses 31% of the transfer's time" in flat
    # The table's first parameter, a long name, in full across its wrapped lines.
    table = text.split("parameter groups:\n", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    column = "".join(row[2 + 13 + 2 + 10 + 2 + 6 + 2 + 9 + 2:].strip() for row in table)
    firsts = [g["params"][0] for g in explain_json(choice)["groups"]]
    assert "encoder.layers.0.self_attn.in_proj_weight" in firsts
    assert column == "".join(firsts)

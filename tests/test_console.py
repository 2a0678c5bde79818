"""Terminal output off a terminal: tables fit 80 columns or fold into `label: value` lines, prose wraps between
words, and what a person copies (a path, a command) is never cut."""

from __future__ import annotations

import io
import shlex

from rich.console import Console

from mass_ops.console import Column, command_lines, human, label, print_path, print_prose, print_table


def printed(call, width: int = 80) -> list[str]:
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    call(console)
    return console.export_text().splitlines()


def test_a_table_that_fits_is_a_table_and_one_that_does_not_folds_into_label_value_lines():
    columns = [Column("stage"), Column("tokens", numeric=True)]
    narrow = printed(lambda c: print_table(c, "Spend", columns, [["search", "1,200"]]))
    assert any("│ search" in line and "1,200 │" in line for line in narrow)
    wide_columns = [Column("stage"), *(Column(f"a long header {i}", numeric=True) for i in range(6))]
    row = ["collect", *(f"{i},000,000" for i in range(6))]
    wide = printed(lambda c: print_table(c, "Spend", wide_columns, [row]))
    assert wide[:2] == ["Spend:", "  collect"]
    assert "    a long header 5: 5,000,000" in wide
    assert all(len(line) <= 80 for line in narrow + wide)


def test_prose_wraps_between_words_and_a_path_stays_whole():
    path = "/tmp/" + "x" * 90 + "/report.html"
    lines = printed(lambda c: print_prose(c, f"the report is at {path} and more words " * 2))
    assert path in [line.strip() for line in lines]
    assert all(len(line) <= 80 for line in lines if path not in line)
    assert printed(lambda c: print_path(c, "report", path)) == ["report:", f"  {path}"]
    assert printed(lambda c: print_path(c, "report", "runs/r.html")) == ["report: runs/r.html"]


def test_a_folded_command_is_the_same_command_to_a_shell():
    for value in ("models.served_name=" + "m" * 40, "models.served_name=" + "m" * 70):
        argv = ["mass-ops", "repair", "demo-L0", "--config", "my config.yaml", "--set", value, "--dry-run"]
        lines = command_lines(argv, 80)
        assert len(lines) > 1 and all(line.endswith(" \\") for line in lines[:-1])
        long = [line.removesuffix(" \\") for line in lines if len(line) > 80]
        assert all(len(line.split()) == 1 for line in long), "only a lone word may be longer than a line"
        assert shlex.split(" ".join(line.removesuffix(" \\") for line in lines)) == argv
    short = command_lines(["mass-ops", "status", "demo-L0", "--config", "demo", "--set", "a=" + "b" * 50], 80)
    assert short[-1].strip() == "--set a=" + "b" * 50, "an option keeps its value when they fit a line"


def test_values_read_as_words():
    assert [human(True), human(False), human(None), human(1_010_200), human(["a", "b"])] == [
        "yes", "no", "—", "1,010,200", "a, b",
    ]  # fmt: skip
    assert label("bf16_uri") == "BF16 model" and label("train_trajectories") == "train trajectories"

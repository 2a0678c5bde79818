"""Terminal output that survives pipes and narrow terminals.

Tables are printed whole when every cell fits on one line within the console's width (80 columns off a terminal
unless COLUMNS says otherwise); otherwise each row folds into ``label: value`` lines. Prose wraps between words only.
What a person copies — a path, a URL, a command — is never cut: a path or URL stands whole on its own line, and a
command folds only between its arguments, with shell line continuations, so the folded text still pastes as one
command. Values read as words and units (`human`), never as Python reprs.
"""

from __future__ import annotations

import shlex
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

MISSING = "—"
# Field names that read badly when only their underscores are replaced.
LABELS = {
    "bf16_uri": "BF16 model",
    "fp8_uri": "FP8 model",
    "uri": "location",
    "html": "report (HTML)",
    "markdown": "report (Markdown)",
    "log": "Airflow logs",
    "logs": "Airflow logs",
    "win_rate": "win rate",
    "stand_in_judge": "stand-in judge",
    "run_id": "DAG run",
    "gpu_hours": "GPU-hours",
    "wall_clock_h": "wall-clock (h)",
    "tokens_per_s": "tokens/s",
    "config_hash": "config hash",
    "fp8_block": "FP8 block",
    "rhi_episodes": "RHI episodes",
    "val_trajectories": "validation trajectories",
    "self_judge_calls": "self-judge calls",
}


def label(key: str) -> str:
    """A field name as a person reads it: `LABELS`, else its words (`train_trajectories` → "train trajectories")."""
    return LABELS.get(key, key.replace("_", " "))


def human(value: Any) -> str:
    """A value as words: yes/no for booleans, "—" for nothing, rounded floats, lists and mappings as short text."""
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, Mapping):
        return "; ".join(f"{label(str(k))}: {human(v)}" for k, v in value.items()) or MISSING
    if isinstance(value, list | tuple):
        return ", ".join(human(v) for v in value) or MISSING
    return str(value)


@dataclass(frozen=True)
class Column:
    """A table column: its header and whether its cells are numbers (right-aligned)."""

    header: str
    numeric: bool = False


def table_width(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> int:
    """The width of a Rich table (default box, padding 1) whose every cell stays on one line."""
    widths = [cell_len(c.header) for c in columns]
    for row in rows:
        widths = [max(w, cell_len(cell)) for w, cell in zip(widths, row, strict=True)]
    return sum(widths) + 3 * len(columns) + 1


def print_table(
    console: Console, title: str, columns: Sequence[Column], rows: Sequence[Sequence[str]], *, caption: str = ""
) -> None:
    """A table when it fits the console on one line per row, else each row as its first cell followed by indented
    ``header: value`` lines (empty cells left out)."""
    if table_width(columns, rows) <= console.width and cell_len(title) <= console.width:
        table = Table(title=title, title_justify="left")
        for column in columns:
            table.add_column(column.header, justify="right" if column.numeric else "left", no_wrap=True)
        for row in rows:
            table.add_row(*(Text(cell) for cell in row))  # data, never markup: "[t51]" is no style tag
        console.print(table)
    else:
        print_prose(console, title + ":")
        for row in rows:
            print_prose(console, row[0], indent="  ")
            for column, cell in zip(columns[1:], row[1:], strict=True):
                if cell:
                    print_prose(console, f"{column.header}: {cell}", indent="    ", hanging="      ")
    if caption:
        print_prose(console, caption)


def print_prose(console: Console, text: str, *, indent: str = "", hanging: str | None = None) -> None:
    """Text wrapped between words to the console's width; a word longer than a line (a path) is kept whole."""
    lines = textwrap.wrap(
        text,
        width=max(20, console.width),
        initial_indent=indent,
        subsequent_indent=indent if hanging is None else hanging,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [indent]
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def print_path(console: Console, what: str, location: str) -> None:
    """``what: location`` on one line when it fits, else `what:` with the location whole on the next line."""
    line = f"{what}: {location}"
    if cell_len(line) <= console.width:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    else:
        console.print(f"{what}:", markup=False, highlight=False, soft_wrap=True)
        console.print(f"  {location}", markup=False, highlight=False, soft_wrap=True)


def command_lines(argv: Sequence[str] | str, width: int = 80, indent: str = "  ") -> list[str]:
    """A shell command folded between its arguments with `` \\`` continuations so each line fits `width` where an
    argument allows (an option stays with its value); pasted into a shell, the lines are the one command. A string is
    split as the shell would."""
    words = [shlex.quote(a) for a in (shlex.split(argv) if isinstance(argv, str) else argv)]
    groups: list[str] = []
    for word in words:
        option = groups[-1] if groups else ""
        fits = cell_len(indent) + 4 + cell_len(option) + 1 + cell_len(word) + 2 <= width  # on a line of its own
        if option.startswith("-") and " " not in option and not word.startswith("-") and fits:
            groups[-1] += f" {word}"
        else:
            groups.append(word)
    lines: list[str] = []
    current = ""
    for group in groups:
        candidate = f"{current} {group}" if current else group
        # Room for the indent and the " \\" that ends every line but the last.
        if current and cell_len(indent) + cell_len(candidate) + 2 > width:
            lines.append(f"{indent}{current} \\")
            current = "    " + group
        else:
            current = candidate
    lines.append(indent + current)
    return lines


def print_command(console: Console, argv: Sequence[str] | str, *, indent: str = "  ") -> None:
    """A command to copy, folded by `command_lines`."""
    for line in command_lines(argv, console.width, indent):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def heading(console: Console, text: str) -> None:
    """A rule with `text` when it fits, else the text as prose (a rule would cut it)."""
    if cell_len(text) + 6 <= console.width:
        console.rule(Text(text))
    else:
        print_prose(console, text)

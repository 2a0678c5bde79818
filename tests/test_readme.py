"""The README's "Where things live" names what is in the tree, and everything at the top of the package."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mass_ops"


def where_things_live(text: str) -> str:
    """The code block under the README's "Where things live" heading."""
    section = text.split("## Where things live", 1)[1]
    return section.split("```", 2)[1]


def named_paths(block: str) -> list[tuple[str, str]]:
    """(parent, name) for each path in the block's left column: `dags/`, `  cli.py console/` under `mass_ops/`."""
    found = []
    parent = ""
    for line in block.splitlines():
        column = line[:28]
        if not column.strip():
            continue
        indented = column.startswith("  ")
        names = column.split()
        if not indented:
            parent = names[0] if len(names) == 1 and names[0].endswith("/") else ""
        for name in names:
            found.append((parent if indented else "", name))
    return found


def test_every_path_the_readme_names_exists():
    block = where_things_live((ROOT / "README.md").read_text(encoding="utf-8"))
    paths = named_paths(block)
    assert len(paths) > 20, paths
    missing = [f"{parent}{name}" for parent, name in paths if not (ROOT / parent / name).exists()]
    assert missing == []


def test_the_readme_names_every_package_and_module_at_the_top_of_mass_ops():
    block = where_things_live((ROOT / "README.md").read_text(encoding="utf-8"))
    named = {name.rstrip("/") for parent, name in named_paths(block) if parent == "mass_ops/"}
    present = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    present |= {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    present |= {"presets"}  # data, not a package
    assert sorted(present - named) == [], "add them to the README's Where things live"
    assert sorted(named - present) == []


def test_the_reader_sees_a_missing_path(tmp_path):
    block = "mass_ops/   the platform\n  nowhere.py   gone\n"
    (parent, name) = named_paths(block)[1]
    assert not (ROOT / parent / name).exists()


def test_links_stay_inside_the_repository():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#]+)", text)
    assert links, "the reader finds the links"
    outside = [link for link in links if link.startswith(("http:", "https:", "/", "..")) or not (ROOT / link).exists()]
    assert outside == []

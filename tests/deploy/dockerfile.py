"""A small Dockerfile reader for the image tests: instructions, their flags and build stages.

It covers the syntax our Dockerfiles use (line continuations, comments, `--flag=value` options, `AS name` stages,
`KEY=value` pairs in ARG/ENV); hadolint does the full linting.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

_FLAG = re.compile(r"^--([a-z-]+)(?:=(\S*))?$")


@dataclass(frozen=True)
class Instruction:
    """One instruction: upper-case keyword, its `--flags` and the rest of its text."""

    keyword: str
    flags: dict[str, str]
    text: str
    line: int


@dataclass
class Stage:
    """One build stage: its base image reference, optional name and instructions (FROM excluded)."""

    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def args(self) -> dict[str, str]:
        """ARG defaults of this stage (an ARG without default maps to "")."""
        return dict(_pairs(i.text) for i in self.all("ARG"))

    def env(self) -> dict[str, str]:
        merged: dict[str, str] = {}
        for instruction in self.all("ENV"):
            merged.update(_env_pairs(instruction.text))
        return merged


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage_names(self) -> set[str]:
        return {s.name for s in self.stages if s.name}


def read_dockerfile(path: Path) -> Dockerfile:
    """Parse `path` into stages; raises ValueError naming the line of anything it cannot read."""
    instructions = list(_instructions(path.read_text(encoding="utf-8"), path))
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            words = instruction.text.split()
            if len(words) == 3 and words[1].upper() == "AS":
                stages.append(Stage(base=words[0], name=words[2]))
            elif len(words) == 1:
                stages.append(Stage(base=words[0], name=None))
            else:
                raise ValueError(f"{path}:{instruction.line}: cannot read FROM {instruction.text!r}")
        elif not stages:
            if instruction.keyword != "ARG":
                raise ValueError(f"{path}:{instruction.line}: {instruction.keyword} before the first FROM")
            global_args.update([_pairs(instruction.text)])
        else:
            stages[-1].instructions.append(instruction)
    if not stages:
        raise ValueError(f"{path}: no FROM instruction")
    return Dockerfile(path=path, global_args=global_args, stages=stages)


def copy_sources(instruction: Instruction) -> list[str]:
    """Source paths of a COPY/ADD (everything but the destination); JSON-array form is not used here."""
    words = shlex.split(instruction.text)
    return words[:-1]


def _instructions(text: str, path: Path):
    logical: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not logical and (not stripped or stripped.startswith("#")):
            continue
        if logical and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction are dropped by Docker too
        if not logical:
            start = number
        if stripped.endswith("\\"):
            logical.append(stripped[:-1].rstrip())
            continue
        logical.append(stripped)
        yield _instruction(" ".join(part for part in logical if part), start, path)
        logical = []
    if logical:
        raise ValueError(f"{path}:{start}: instruction continues past the end of the file")


def _instruction(line: str, number: int, path: Path) -> Instruction:
    keyword, _, rest = line.partition(" ")
    flags: dict[str, str] = {}
    words = rest.split(" ")
    while words and words[0].startswith("--"):
        match = _FLAG.match(words[0])
        if match is None:
            raise ValueError(f"{path}:{number}: cannot read flag {words[0]!r}")
        key, value = match.group(1), match.group(2) or ""
        flags[key] = f"{flags[key]} {value}" if key in flags else value
        words.pop(0)
    return Instruction(keyword=keyword.upper(), flags=flags, text=" ".join(words).strip(), line=number)


def _pairs(text: str) -> tuple[str, str]:
    name, _, default = text.partition("=")
    return name.strip(), default.strip().strip('"')


def _env_pairs(text: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for word in shlex.split(text):
        name, sep, value = word.partition("=")
        if not sep:
            raise ValueError(f"ENV {text!r}: only the KEY=value form is read")
        pairs[name] = value
    return pairs

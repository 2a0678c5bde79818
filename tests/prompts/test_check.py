"""`mass-ops prompts check`: the built-in examples of every message kind, and a recorded cycle's messages rendered
again from their recorded inputs, with the shipped templates (same as sent) and with a user's (what changes)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from mass_ops.prompts import shipped_prompts
from mass_ops.prompts.check import MACRO_LIBRARIES, MESSAGE_TEMPLATES, example_messages, recorded_messages
from mass_ops.prompts.library import load_prompts
from mass_ops.prompts.specs import TEMPLATES
from mass_ops.search import search_step
from mass_ops.stages.collect import freeze_teacher_prompt
from tests.inner_loop_fakes import InnerLoopEnv, inner_loop_fixture  # noqa: F401


def test_every_template_is_a_message_or_a_library_a_message_imports() -> None:
    sources = "".join(shipped_prompts().templates[name].source for name in MESSAGE_TEMPLATES)
    assert set(MESSAGE_TEMPLATES) | MACRO_LIBRARIES == set(TEMPLATES)
    for library in MACRO_LIBRARIES:
        assert f'"{library}"' in sources, f"{library} is neither a message nor imported by one"


def test_the_examples_cover_every_message_template_and_follow_an_override(tmp_path: Path) -> None:
    shipped = example_messages(shipped_prompts())
    assert {m.template for m in shipped} == set(MESSAGE_TEMPLATES)
    assert all(len(m.sha256 or "") == 64 and m.chars for m in shipped)
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "optimizer_system.j2").write_text("Improve the design.\n", encoding="utf-8")
    mine = example_messages(load_prompts(folder))
    changed = {a.template for a, b in zip(shipped, mine, strict=True) if a.sha256 != b.sha256}
    assert changed == {"optimizer_system.j2"}
    assert (
        next(m for m in mine if m.template == "optimizer_system.j2").sha256
        == hashlib.sha256(b"Improve the design.").hexdigest()
    )


def test_a_recorded_cycle_renders_again_to_what_was_sent(inner_loop: InnerLoopEnv, tmp_path: Path) -> None:
    inner_loop.policy.judge_winner = lambda request: "B"
    opened = inner_loop.open(tasks=(51,), iterations=1)
    search_step(opened.ctx, opened.executor, 51, 0, client=opened.client)
    search_step(opened.ctx, opened.executor, 51, 1, client=opened.client)  # 2 verdicts + 1 arbitration
    freeze_teacher_prompt(opened.ctx, 51, 1)
    config, cycle = opened.ctx.config, opened.ctx.cycle_name

    checked = recorded_messages(shipped_prompts(), config, cycle)
    templates = sorted(m.template or "" for m in checked)
    assert templates == sorted(["optimizer_system.j2", "optimizer_user.j2", "teacher_prompt.j2"] + 3 * [
        "judge_system.j2", "judge_user.j2"
    ])  # fmt: skip
    assert {m.verdict for m in checked} == {"same as recorded"}, [m.as_dict() for m in checked]
    sent = {hashlib.sha256(r["messages"][1]["content"].encode()).hexdigest() for r in inner_loop.judge_requests()}
    assert sent == {m.sha256 for m in checked if m.template == "judge_user.j2"}

    folder = tmp_path / "mine"
    folder.mkdir()
    user = shipped_prompts().templates["judge_user.j2"].source
    (folder / "judge_user.j2").write_text(user.replace("# Task", "# The task", 1), encoding="utf-8")
    again = recorded_messages(load_prompts(folder), config, cycle)
    assert {m.template for m in again if m.verdict == "differs from recorded"} == {"judge_user.j2"}


def test_the_command_prints_each_message_and_refuses_an_unknown_cycle(tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "mass_ops.cli", "prompts", "check", "--config", "demo"]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert sum(1 for line in lines if line.startswith("  sha256 ")) == len(example_messages(shipped_prompts()))
    assert all(len(line) <= 80 for line in lines)
    store = ["--set", f"storage.metadata_url=sqlite:///{tmp_path / 'm.db'}"]
    upgrade = [sys.executable, "-m", "mass_ops.cli", "db", "upgrade", "--config", "demo", *store]
    subprocess.run(upgrade, capture_output=True, text=True, timeout=120, check=True)
    missing = subprocess.run(
        [*cli, "--cycle", "no-such-cycle", *store],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert missing.returncode == 2 and "no cycle 'no-such-cycle'" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1, missing.stderr


@pytest.mark.parametrize("name", sorted(MESSAGE_TEMPLATES))
def test_each_message_template_is_described(name: str) -> None:
    assert MESSAGE_TEMPLATES[name] and TEMPLATES[name].samples

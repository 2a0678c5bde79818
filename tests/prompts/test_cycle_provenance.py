"""A cycle records the SHA-256 of every prompt template it uses, runs its stages with those templates, and refuses
templates that changed since it was opened (`open_cycle` / `attach_cycle`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mass_ops.config import ConfigError, CycleConfig, load_config
from mass_ops.context import attach_cycle, open_cycle
from mass_ops.judge.prompts import judge_system_prompt
from mass_ops.prompts import load_prompts, shipped_prompts
from tests.inner_loop_fakes import migrated_sqlite

OWN_JUDGE = "{# mine #}\nJudge task {{ task_id }} strictly.\n"


def demo_config(tmp_path: Path, metadata_url: str, prompts_dir: Path | None = None) -> CycleConfig:
    sets = [f"storage.metadata_url={metadata_url}", f"storage.artifact_url={tmp_path / 'artifacts'}"]
    if prompts_dir is not None:
        sets.append(f"prompts.dir={prompts_dir}")
    return load_config("demo", sets, environ={})


def test_open_cycle_records_the_shipped_digests(tmp_path: Path) -> None:
    ctx = open_cycle(demo_config(tmp_path, migrated_sqlite(tmp_path / "m.db")), upgrade_schema=False)
    cycle = ctx.repo.get_cycle(ctx.cycle_name)
    assert cycle is not None and cycle.provenance is not None
    assert cycle.provenance["prompts"] == shipped_prompts().digests()


def test_a_cycle_runs_with_its_override_and_refuses_a_changed_one(tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "judge_system.j2").write_text(OWN_JUDGE, encoding="utf-8")
    config = demo_config(tmp_path, migrated_sqlite(tmp_path / "m.db"), folder)
    ctx = open_cycle(config, upgrade_schema=False)
    recorded = ctx.repo.get_cycle(ctx.cycle_name).provenance["prompts"]  # type: ignore[union-attr]
    assert recorded == load_prompts(folder).digests() != shipped_prompts().digests()
    assert judge_system_prompt(51, prompts=ctx.prompts) == "Judge task 51 strictly."  # the cycle's prompts
    attach_cycle(config)  # unchanged: attaches

    (folder / "judge_system.j2").write_text(OWN_JUDGE.replace("strictly", "kindly"), encoding="utf-8")
    for stage in (attach_cycle, open_cycle):
        with pytest.raises(ConfigError) as caught:
            stage(config)
        assert caught.value.problems == [
            f"config: prompts: template(s) judge_system.j2 differ from those cycle {config.cycle_name!r} was opened "
            "with (SHA-256 on its cycle row); restore them or run the changed prompts under a new cycle name"
        ]
    assert ctx.repo.get_cycle(ctx.cycle_name).provenance["prompts"] == recorded  # type: ignore[union-attr]


def test_a_broken_template_stops_open_cycle_before_anything_is_written(tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "teacher_prompt.j2").write_text("{{ retained_prompt }}{{ directive }}", encoding="utf-8")
    database = tmp_path / "fresh.db"
    with pytest.raises(ConfigError, match=r"teacher_prompt\.j2: uses unknown variable\(s\) directive"):
        open_cycle(demo_config(tmp_path, f"sqlite:///{database}", folder))
    assert not database.exists() and not (tmp_path / "artifacts").exists()

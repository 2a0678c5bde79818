"""The shipped task catalogue: ids, splits, prompt format and lookups (MASS_SPEC §0)."""

from __future__ import annotations

import hashlib
import json
import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest

import mass_ops
from mass_ops.prompts import shipped_prompts
from mass_ops.stages.collect import teacher_prompt
from mass_ops.tasks import (
    Task,
    TaskFormatError,
    UnknownTaskError,
    builtin_catalogue_dir,
    import_task_dir,
    load_catalogue,
)
from mass_ops.workflow import END_MARKER, START_MARKER, parse_prompt

CATALOGUE = load_catalogue()

# The table of MASS_SPEC §0: id -> (domain, split).
EXPECTED = {
    51: ("finance", "train"),
    53: ("finance", "train"),
    56: ("finance", "train"),
    60: ("finance", "test"),
    202: ("pharmacy", "train"),
    205: ("pharmacy", "train"),
    207: ("pharmacy", "test"),
    221: ("pharmacy", "train"),
    302: ("robotics", "train"),
    305: ("robotics", "test"),
    307: ("robotics", "train"),
    324: ("robotics", "train"),
}
DELIVERABLE_PATHS = (
    "research_report.md",
    "deliverables/index.json",
    "deliverables/plots/",
    "requirements.txt",
    "run_pipeline.py",
    "results/metrics.json",
    "results/model_comparison.json",
    "results/ablation_log.json",
)


def test_ids_domains_and_splits_match_the_reference_table() -> None:
    assert {task.id: (task.domain, task.split) for task in CATALOGUE} == EXPECTED
    assert CATALOGUE.designated_train_ids == [51, 53, 56, 202, 205, 221, 302, 307, 324]
    assert CATALOGUE.test_ids == [60, 207, 305]
    assert CATALOGUE.sft_train_ids == [51, 53, 56, 202, 205, 302, 307, 324]
    assert CATALOGUE.excluded_ids == [221]


def test_task_221_is_excluded_but_stays_in_training() -> None:
    task = CATALOGUE.task(221)
    assert task.excluded and task.split == "train" and not task.in_sft
    assert task.exclusion_reason and "reference" in task.exclusion_reason
    assert all(CATALOGUE.task(i).in_sft for i in CATALOGUE.sft_train_ids)
    assert not any(CATALOGUE.task(i).in_sft for i in CATALOGUE.test_ids)


def test_splits_file_has_the_reference_keys() -> None:
    raw = json.loads((builtin_catalogue_dir() / "splits.json").read_text(encoding="utf-8"))
    assert set(raw) == {
        "designated_train",
        "test",
        "sft_train",
        "excluded_from_teacher_collection",
        "domains",
        "task_prompt_pattern",
        "initial_workflow_pattern",
    }
    assert raw["task_prompt_pattern"] == "bare/query{task_id}.txt"
    assert raw["initial_workflow_pattern"] == "initial/query{task_id}_ourTeam.txt"
    assert list(raw["excluded_from_teacher_collection"]) == ["221"]


@pytest.mark.parametrize("task", list(CATALOGUE), ids=lambda task: task.name)
def test_prompt_format(task: Task) -> None:
    for prompt in (task.bare_prompt, task.initial_prompt):
        assert 1536 <= len(prompt.encode("utf-8")) <= 4096
        # qwen-code rewrites "x@y" as a path reference, which would break teacher-prompt matching in rendering.
        assert "@" not in prompt
    task_line, _, suffix = task.bare_prompt.partition("\n\n")
    # One physical line of task text whose line breaks are literal two-character escapes.
    assert "\n" not in task_line and "\\n" in task_line
    assert suffix.startswith(END_MARKER)
    for tool in ("uv run", "uv add", "uvx", "logs.txt", "Plan", "Execution", "Reflection"):
        assert tool in suffix
    text = task.task_text
    assert "Deliverables:" in text
    for path in DELIVERABLE_PATHS:
        assert path in text, path
    assert text.count(".png") >= 4
    # Doable offline: the agent generates its own data from a seed.
    assert "offline from a fixed seed" in text
    assert any(word in text for word in ("Simulate", "simulat", "Generate seeded", "generator"))


@pytest.mark.parametrize("task", list(CATALOGUE), ids=lambda task: task.name)
def test_initial_prompt_extends_the_bare_task(task: Task) -> None:
    workflow = task.initial_workflow
    assert workflow.task_text == task.task_text
    assert workflow.before_design.endswith("\n\n")
    assert workflow.design_block.startswith(START_MARKER)
    bare_suffix = task.bare_prompt[task.bare_prompt.index(END_MARKER) :].rstrip()
    assert workflow.after_design.startswith(bare_suffix)
    extra = workflow.after_design[len(bare_suffix) :]
    for phrase in ("logs.txt", "spawned", "workflow", "executed"):
        assert phrase in extra
    roles = [agent.role for agent in task.initial_agents]
    assert len(set(roles)) == len(roles)


def test_task_texts_are_distinct() -> None:
    texts = [task.task_text for task in CATALOGUE]
    assert len(set(texts)) == len(texts)
    first_sentences = {text.split(".")[0] for text in texts}
    assert len(first_sentences) == len(texts)


def test_teacher_directive_has_seven_rules() -> None:
    directive = CATALOGUE.teacher_directive
    lines = directive.splitlines()
    assert lines[0] == "Execution requirements for the agent team (mandatory)"
    assert [line.split(".")[0] for line in lines[1:]] == [str(i) for i in range(1, 8)]
    for fragment in ('subagent_type "general-purpose"', "run_in_background: false", "disjoint files"):
        assert fragment in directive
    assert directive == directive.strip()


def test_teacher_prompt_appends_the_directive() -> None:
    retained = CATALOGUE.task(51).initial_prompt
    ctx = SimpleNamespace(prompts=shipped_prompts(), catalogue=CATALOGUE)
    prompt = teacher_prompt(ctx, retained + "\n\n  \n")  # type: ignore[arg-type]
    # The directive exactly as its file reads, final newline kept (MASS_SPEC §1 collect).
    assert prompt == retained.rstrip() + "\n\n" + CATALOGUE.teacher_directive + "\n"
    assert prompt.count(CATALOGUE.teacher_directive) == 1


def test_lookups() -> None:
    assert len(CATALOGUE) == 12 and 51 in CATALOGUE and 52 not in CATALOGUE
    assert [task.id for task in CATALOGUE.tasks_for("test")] == [60, 207, 305]
    assert CATALOGUE.ids_for("all") == [51, 53, 56, 202, 205, 221, 302, 307, 324, 60, 207, 305]
    assert CATALOGUE.ids_for("sft_train") == CATALOGUE.sft_train_ids
    assert CATALOGUE.ids_for("designated_train") == CATALOGUE.designated_train_ids
    assert [task.id for task in CATALOGUE.by_domain("robotics")] == [302, 305, 307, 324]
    task = CATALOGUE.task(305)
    assert (task.name, task.workflow_name) == ("query305", "query305_ourTeam")


@pytest.mark.parametrize(
    ("call", "problem"),
    [
        (lambda: CATALOGUE.task(999), "unknown task id 999"),
        (lambda: CATALOGUE.ids_for("train"), "unknown split 'train'"),
        (lambda: CATALOGUE.by_domain("chemistry"), "unknown domain 'chemistry'"),
    ],
)
def test_unknown_lookups_raise(call, problem: str) -> None:
    with pytest.raises(UnknownTaskError, match=problem):
        call()


def test_load_catalogue_from_a_path(tmp_path) -> None:
    copy = tmp_path / "tasks"
    shutil.copytree(builtin_catalogue_dir(), copy)
    initial = copy / "initial" / "query51_ourTeam.txt"
    prompt = parse_prompt(initial.read_text(encoding="utf-8"))
    initial.write_text(prompt.render(prompt.design_block.replace("lead quant", "head quant")), encoding="utf-8")
    loaded = load_catalogue(str(copy))
    assert loaded.source == copy
    assert "head quant researcher" in loaded.task(51).initial_prompt
    assert loaded.task(53) == CATALOGUE.task(53)


# --- Provenance and identity (#12.4) -------------------------------------------------------------------------------


def _sha256_of_files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "provenance.json"
    }


def test_the_builtin_catalogue_is_named_builtin() -> None:
    assert CATALOGUE.identity() == "builtin"
    assert CATALOGUE.provenance is None
    assert CATALOGUE.file_sha256 == _sha256_of_files(builtin_catalogue_dir())


def test_an_import_records_its_provenance_and_the_loader_exposes_it(tmp_path: Path) -> None:
    src = tmp_path / "deep" / "reference-tasks"
    shutil.copytree(builtin_catalogue_dir(), src)
    when = datetime(2026, 5, 9, 7, 35, 25, tzinfo=timezone(timedelta(hours=2)))
    dest = tmp_path / "catalogues" / "ref"
    import_task_dir(src, dest, now=when)

    recorded = json.loads((dest / "provenance.json").read_text(encoding="utf-8"))
    assert recorded == {
        "source": "reference-tasks",  # the folder's name, never its full path
        "files": _sha256_of_files(dest),
        "imported_at": "2026-05-09T05:35:25+00:00",
        "mass_ops_version": mass_ops.__version__,
    }
    assert str(tmp_path) not in (dest / "provenance.json").read_text(encoding="utf-8")

    loaded = load_catalogue(dest)
    assert loaded.provenance is not None
    assert loaded.provenance.as_dict() == recorded
    digest = hashlib.sha256(
        "".join(f"{name}\t{sha}\n" for name, sha in sorted(recorded["files"].items())).encode()
    ).hexdigest()
    assert loaded.identity() == f"imported:reference-tasks@{digest[:12]}"


def test_identity_follows_the_contents_not_the_location(tmp_path: Path) -> None:
    src = tmp_path / "tasks"
    shutil.copytree(builtin_catalogue_dir(), src)
    first = import_task_dir(src, tmp_path / "a").identity()
    assert import_task_dir(src, tmp_path / "b" / "c").identity() == first
    (src / "teacher_directive.txt").write_text("A different directive.\n", encoding="utf-8")
    assert import_task_dir(src, tmp_path / "d").identity() != first
    assert load_catalogue(src).identity().startswith("unimported:tasks@")


def test_an_imported_catalogue_edited_afterwards_is_refused(tmp_path: Path) -> None:
    dest = tmp_path / "imported"
    import_task_dir(builtin_catalogue_dir(), dest)
    directive = dest / "teacher_directive.txt"
    directive.write_text(directive.read_text(encoding="utf-8") + "8. One more rule.\n", encoding="utf-8")
    with pytest.raises(TaskFormatError, match=r"provenance\.json: teacher_directive\.txt changed since the import"):
        load_catalogue(dest)
    (dest / "provenance.json").write_text("{}", encoding="utf-8")
    with pytest.raises(TaskFormatError, match="must hold source, files"):
        load_catalogue(dest)
    (dest / "provenance.json").write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    with pytest.raises(TaskFormatError, match=r"provenance\.json: invalid JSON: JSON nested deeper than the parser"):
        load_catalogue(dest)

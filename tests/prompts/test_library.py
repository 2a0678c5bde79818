"""Prompt templates: byte-identical to the texts the Python builders made before, overrides by file name, and a
broken or unknown template refused in one line before anything runs."""

from __future__ import annotations

import json
import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace

import pytest

from mass_ops.config import ConfigError, load_config
from mass_ops.judge.evidence import EvidenceBundle
from mass_ops.judge.prompts import judge_system_prompt, judge_user_prompt
from mass_ops.prompts import (
    TEMPLATES,
    PromptError,
    check_recorded,
    check_templates,
    load_prompts,
    shipped_prompts,
)
from mass_ops.prompts.library import TEMPLATE_DIR
from mass_ops.search.prompt import failure_notice, optimizer_system_prompt
from mass_ops.stages.collect import teacher_prompt
from mass_ops.tasks.importer import load_catalogue
from tests.prompts.cases import prompt_cases

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).with_name("rendered_prompts.json")


def write(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


# -- the shipped templates reproduce the string-built prompts -------------------------------------------------------


def test_every_case_renders_byte_identical_to_the_string_built_prompt() -> None:
    expected = json.loads(FIXTURE.read_text(encoding="utf-8"))["prompts"]
    cases = prompt_cases()
    assert sorted(cases) == sorted(expected)
    mismatched = [name for name, build in cases.items() if build() != expected[name]]
    assert mismatched == []


def test_the_shipped_templates_pass_their_own_check() -> None:
    shipped_prompts().check()
    assert sorted(TEMPLATES) == sorted(p.name for p in TEMPLATE_DIR.iterdir())


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_each_template_documents_every_variable_in_its_header(name: str) -> None:
    source = (TEMPLATE_DIR / name).read_text(encoding="utf-8")
    assert source.startswith("{#") and "#}" in source
    header = source[: source.index("#}")]
    assert name in header
    undocumented = [variable for variable in TEMPLATES[name].variables if variable not in header]
    assert undocumented == []
    macros = [macro for macro in TEMPLATES[name].macros if f"{macro}(" not in header]
    assert macros == []


def test_the_templates_ship_as_package_data() -> None:
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["mass_ops"]
    for name in TEMPLATES:
        relative = (TEMPLATE_DIR / name).relative_to(ROOT / "mass_ops").as_posix()
        assert any(fnmatch(relative, pattern) for pattern in patterns), relative


# -- overrides ------------------------------------------------------------------------------------------------------


def test_a_folder_replaces_only_the_templates_it_holds(tmp_path: Path) -> None:
    folder = write(tmp_path / "mine", {"judge_system.j2": "{# mine #}\nJudge task {{ task_id }} as a reviewer.\n"})
    prompts = load_prompts(folder)
    assert prompts.overridden == ["judge_system.j2"]
    assert judge_system_prompt(51, prompts=prompts) == "Judge task 51 as a reviewer."
    assert optimizer_system_prompt(prompts=prompts) == optimizer_system_prompt()
    shipped = shipped_prompts().digests()
    changed = [name for name, sha in prompts.digests().items() if sha != shipped[name]]
    assert changed == ["judge_system.j2"]
    assert judge_system_prompt(51) != judge_system_prompt(51, prompts=prompts)  # nothing is installed process-wide


def test_an_override_reaches_the_judge_message_the_teacher_prompt_and_the_optimizer_parts(tmp_path: Path) -> None:
    folder = write(
        tmp_path / "mine",
        {
            "judge_user.j2": (
                '{% from "evidence.j2" import evidence %}T={{ task_text }}|{{ label_a }}|{{ label_b }}\n'
                '{{ evidence(evidence_a, "A") }}\n{{ evidence(evidence_b, "B") }}\n'
            ),
            "evidence.j2": (
                "{% macro token_cut_marker() %}~{% endmacro %}{% macro appendix_cut_marker() %}~{% endmacro %}\n"
                "{% macro results_appendix(appendix) %}{{ appendix.files | length }}{% endmacro %}\n"
                "{% macro evidence(bundle, heading) %}{{ heading }}@{{ bundle.location }}:{{ bundle.tree.root }}"
                "{% endmacro %}\n"
            ),
            "teacher_prompt.j2": "{{ retained_prompt }}\n\nTheir own directive.\n",
            "optimizer_parts.j2": (
                "{% macro failure_notice(failed, prior_failures) %}{{ 'FAILED' if failed else '' }}{% endmacro %}\n"
                "{% macro scoreboard(entries) %}{{ entries | length }}{% endmacro %}\n"
                "{% macro delta_checklist(rows, has_history) %}none{% endmacro %}\n"
                "{% macro cut(text) %}{{ text.text }}{% endmacro %}\n"
            ),
        },
    )
    prompts = load_prompts(folder)
    prompts.check()
    a = EvidenceBundle(51, "query_51", "a", tree={"root": "ra"})
    b = EvidenceBundle(51, "query_51", "b", tree={"root": "rb"})
    assert judge_user_prompt(" t ", "x", "y", a, b, prompts=prompts) == "T=t|x|y\nA@a:ra\nB@b:rb"
    catalogue = load_catalogue()
    ctx = SimpleNamespace(prompts=prompts, catalogue=catalogue)
    assert teacher_prompt(ctx, "retained  \n") == "retained\n\nTheir own directive."  # type: ignore[arg-type]
    assert failure_notice({"exit_code": 1}, prompts=prompts) == "FAILED"
    assert failure_notice({"exit_code": 0, "trace_has_success_result": True}, prompts=prompts) is None


def test_an_unknown_file_in_the_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    folder = write(tmp_path / "mine", {"judge-system.j2": "typo in the name", ".hidden.swp": "ignored"})
    with pytest.raises(ConfigError) as caught:
        load_prompts(folder)
    assert len(caught.value.problems) == 1
    assert "unknown template file(s) ['judge-system.j2']" in caught.value.problems[0]
    (folder / "judge-system.j2").unlink()
    (folder / "sub").mkdir()  # a folder is no template either
    with pytest.raises(ConfigError, match=r"\['sub'\]"):
        load_prompts(folder)


def test_a_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not a folder"):
        load_prompts(tmp_path / "absent")


@pytest.mark.parametrize(
    ("name", "source", "message"),
    [
        ("judge_system.j2", "Hello {{ task_id }\n", r"judge_system\.j2: line 1: unexpected '\}'"),
        ("judge_system.j2", "{% if task_id %}open\n", r"line 1: Unexpected end of template"),
        ("judge_user.j2", "{{ task_text }} {{ verdict_schema }}", r"unknown variable\(s\) verdict_schema"),
        ("optimizer_user.j2", "{% if best %}{{ rubric }}{% endif %}", r"unknown variable\(s\) rubric"),
        ("judge_system.j2", "{{ task_id.nope }}", r"does not render: 'int object' has no attr"),
        ("judge_system.j2", "{{ task_id + 'x' }}", r"does not render: TypeError: unsupported operand"),
        ("teacher_prompt.j2", '{% include "absent.j2" %}', r"does not render: absent\.j2"),
        ("optimizer_parts.j2", "{% macro scoreboard(entries) %}{% endmacro %}", r"no macro\(s\) failure_notice"),
    ],
)
def test_a_broken_template_is_one_config_error(tmp_path: Path, name: str, source: str, message: str) -> None:
    folder = write(tmp_path / "mine", {name: source})
    config = load_config("demo", [f"prompts.dir={folder}"])
    with pytest.raises(ConfigError) as caught:
        check_templates(config)
    assert len(caught.value.problems) == 1 and "\n" not in caught.value.problems[0]
    assert caught.value.problems[0].startswith(f"config: prompts: {folder / name}: ")
    assert caught.value.problems[0] == " ".join(caught.value.problems[0].split())
    assert re.search(message, caught.value.problems[0]), caught.value.problems[0]


def test_a_render_failure_at_call_time_names_the_template(tmp_path: Path) -> None:
    # Samples cannot take every path of a user's template; a failure with real values is still one clear line.
    folder = write(tmp_path / "mine", {"judge_system.j2": "{{ 'x' if task_id < 9999 else 'y'.missing.deeper }}"})
    prompts = load_prompts(folder)
    prompts.check()
    with pytest.raises(PromptError, match=r"prompt template .*judge_system\.j2: 'str object' has no attribute"):
        judge_system_prompt(10000, prompts=prompts)


def test_recorded_digests_must_match(tmp_path: Path) -> None:
    prompts = shipped_prompts()
    check_recorded(prompts, None, "c")
    check_recorded(prompts, prompts.digests(), "c")
    changed = {**prompts.digests(), "judge_user.j2": "0" * 64}
    with pytest.raises(ConfigError, match=r"template\(s\) judge_user\.j2 differ from those cycle 'c' was opened with"):
        check_recorded(prompts, changed, "c")


# -- a template is untrusted code: it renders in the sandbox and an escape is refused at check time -----------------

# Classic escapes from a Jinja2 template into Python: through a global's function globals to `os.system`, and
# through `str`'s class hierarchy. Each would run `touch MARKER` (the first) or list every loaded class (the second).
ESCAPES = {
    "globals": "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}{{ task_id }}",
    "mro": "{{ ''.__class__.__mro__[1].__subclasses__() }}{{ task_id }}",
    "item": "{{ cycler['__init__']['__globals__'] }}{{ task_id }}",
    "attr filter": "{{ (cycler|attr('__init__')) }}{{ task_id }}",
    "hidden branch": "{% if task_id == 123456 %}{{ cycler.__init__.__globals__.os.system('touch MARKER') }}{% endif %}",
}


@pytest.mark.parametrize("source", ESCAPES.values(), ids=ESCAPES.keys())
def test_a_template_that_reaches_python_internals_is_refused_at_check(tmp_path: Path, source: str) -> None:
    folder = write(tmp_path / "mine", {"judge_system.j2": source.replace("MARKER", str(tmp_path / "pwned"))})
    config = load_config("demo", [f"prompts.dir={folder}"])
    with pytest.raises(ConfigError) as caught:
        check_templates(config)
    (line,) = caught.value.problems
    assert line.startswith(f"config: prompts: {folder / 'judge_system.j2'}: ") and "unsafe" in line, line
    assert not (tmp_path / "pwned").exists(), "the check ran the template's command"


def test_an_escape_built_at_run_time_still_cannot_run_code(tmp_path: Path) -> None:
    # The name is assembled while rendering, so no static check can see it: the sandbox refuses it when it is used.
    source = (
        "{% for u in ['_' ~ '_'] %}"
        "{{ (cycler|attr(u ~ 'init' ~ u)|attr(u ~ 'globals' ~ u))['os'].system('touch MARKER') }}{{ task_id }}"
        "{% endfor %}"
    )
    folder = write(tmp_path / "mine", {"judge_system.j2": source.replace("MARKER", str(tmp_path / "pwned"))})
    prompts = load_prompts(folder)
    with pytest.raises(ConfigError, match=r"judge_system\.j2: does not render: .* no attribute '__globals__'"):
        prompts.check()
    with pytest.raises(PromptError, match=r"judge_system\.j2: .* no attribute '__globals__'"):
        judge_system_prompt(51, prompts=prompts)
    assert not (tmp_path / "pwned").exists()

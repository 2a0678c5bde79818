"""`mass-ops prompts list | show NAME | export DIR | check`: see, read, copy and check a config's prompt templates.

Mounted by `mass_ops.cli`. `export` writes editable copies that the config key ``prompts.dir`` can point at.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from mass_ops.config import ConfigError, load_config
from mass_ops.errors import EXIT_INPUT
from mass_ops.prompts.library import PromptSet, check_templates
from mass_ops.prompts.specs import TEMPLATES

prompts_app = typer.Typer(
    no_args_is_help=True,
    help="Prompt templates: list them, show one, export copies to edit (prompts.dir), check the messages they make.",
)

ConfigOption = Annotated[str, typer.Option("--config", "-c", help="Preset (paper, cycle2, demo) or YAML/JSON file.")]
SetOption = Annotated[list[str] | None, typer.Option("--set", help="Override a key: a.b=c (repeatable).")]

_console = Console()
_err_console = Console(stderr=True)


def _fail(lines: list[str], code: int = EXIT_INPUT) -> typer.Exit:
    for line in lines:
        _err_console.print(line, markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _prompts(config: str, overrides: list[str] | None) -> PromptSet:
    """The config's checked prompt set; a config or template problem exits 2 with one line."""
    try:
        return check_templates(load_config(config, overrides or ()))
    except ConfigError as exc:
        raise _fail(exc.problems) from None


@prompts_app.command("list")
def list_templates(config: ConfigOption = "paper", set_: SetOption = None) -> None:
    """Every template the config uses: name, where it comes from, SHA-256 prefix and what it is for."""
    prompts = _prompts(config, set_)
    # Plain lines, one per template, never wrapped: paths stay whole and the output greps well.
    width = max(len(name) for name in prompts.names)
    for name in prompts.names:
        template = prompts.templates[name]
        origin = str(template.origin) if template.origin is not None else "shipped"
        sys.stdout.write(f"{name:<{width}}  {template.sha256[:12]}  {TEMPLATES[name].summary}  [{origin}]\n")


@prompts_app.command("show")
def show_template(
    name: Annotated[str, typer.Argument(help="Template file name, e.g. judge_system.j2.")],
    config: ConfigOption = "paper",
    set_: SetOption = None,
) -> None:
    """Print the source of template NAME as the config uses it."""
    prompts = _prompts(config, set_)
    template = prompts.templates.get(name)
    if template is None:
        raise _fail([f"prompts show: no template {name!r}; templates: {', '.join(prompts.names)}"])
    sys.stdout.write(template.source)


@prompts_app.command("export")
def export_templates(
    dest: Annotated[Path, typer.Argument(help="Folder to write the templates into (created if missing).")],
    config: ConfigOption = "paper",
    set_: SetOption = None,
) -> None:
    """Write every template the config uses into DEST, to edit and use with `--set prompts.dir=DEST`. Refuses to
    overwrite a file; nothing is written unless every template can be."""
    prompts = _prompts(config, set_)
    targets = {name: dest / name for name in prompts.names}
    existing = [str(path) for path in targets.values() if path.exists() or path.is_symlink()]
    if existing:
        names = ", ".join(existing)
        raise _fail([f"prompts export: {names} already exist(s); nothing written (choose an empty folder)"])
    written: list[Path] = []
    try:
        dest.mkdir(parents=True, exist_ok=True)
        for name, path in targets.items():
            with path.open("x", encoding="utf-8", newline="") as handle:  # "x": never replace a file
                written.append(path)
                handle.write(prompts.templates[name].source)
    except OSError as exc:
        for path in written:
            path.unlink(missing_ok=True)
        code = EXIT_INPUT if isinstance(exc, FileExistsError | NotADirectoryError) else 1
        reason = exc.strerror or str(exc)
        raise _fail([f"prompts export: cannot write into {dest}: {reason}; nothing written"], code) from None
    _console.print(f"{len(written)} templates written to {dest}; use them with --set prompts.dir={dest}", markup=False)


@prompts_app.command("check")
def check_messages(
    config: ConfigOption = "paper",
    set_: SetOption = None,
    cycle: Annotated[
        str | None,
        typer.Option("--cycle", help="Render the recorded messages of this cycle (in the config's stores) again."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document instead of lines.")] = False,
) -> None:
    """Render every model-facing message with the config's templates and print each one's SHA-256 and size: the
    built-in examples, or with --cycle every recorded judge, optimizer and teacher message from its recorded inputs
    (compare them with a reference run's)."""
    import json

    from mass_ops.errors import InputError
    from mass_ops.prompts.check import example_messages, recorded_messages, report_lines
    from mass_ops.prompts.library import PromptError

    try:
        cfg = load_config(config, set_ or ())
        prompts = check_templates(cfg)
        messages = example_messages(prompts) if cycle is None else recorded_messages(prompts, cfg, cycle)
    except ConfigError as exc:
        raise _fail(exc.problems) from None
    except (InputError, PromptError) as exc:
        raise _fail([str(exc)]) from None
    if as_json:
        sys.stdout.write(json.dumps([message.as_dict() for message in messages], indent=2) + "\n")
        return
    for line in report_lines(messages):
        sys.stdout.write(line + "\n")
    if not messages:
        sys.stdout.write(f"cycle {cycle}: no recorded messages\n")

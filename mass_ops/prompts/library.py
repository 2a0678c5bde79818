"""Prompt templates: every text a model is sent, as Jinja2 templates shipped in ``mass_ops/prompts/templates``.

``prompts.dir`` replaces any subset of them by file name; `check_templates` parses and renders every template of a
config (and refuses unsafe attribute access statically), so a broken override is a config error at validate time.
Rendering is strict, never HTML-escaped, drops the final newline, and runs in Jinja2's immutable sandbox (a template
is untrusted code). Prompt builders use the `PromptSet` passed to them (a cycle's `CycleContext.prompts`), else the
shipped one; nothing is process-wide. Each used template's SHA-256 is recorded on the cycle row.
Details: docs/configuration.md (`mass_ops.prompts.library`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.sandbox import (
    UNSAFE_ASYNC_GENERATOR_ATTRIBUTES,
    UNSAFE_COROUTINE_ATTRIBUTES,
    UNSAFE_FUNCTION_ATTRIBUTES,
    UNSAFE_GENERATOR_ATTRIBUTES,
    UNSAFE_METHOD_ATTRIBUTES,
    ImmutableSandboxedEnvironment,
)

from mass_ops.config import ConfigError, CycleConfig
from mass_ops.errors import InputError
from mass_ops.prompts.capture import note_render
from mass_ops.prompts.specs import TEMPLATES

TEMPLATE_DIR = Path(__file__).with_name("templates")
# Far above any real prompt template; stops a mistyped folder (a dataset, a model) from being read into memory.
MAX_TEMPLATE_BYTES = 256 * 1024
# Attribute names the sandbox refuses on some object besides every name starting with "_" (`mro` on a type); a
# template naming one is refused at check time even on a branch no sample takes.
UNSAFE_ATTRIBUTES = frozenset(
    {"mro"}
    | UNSAFE_FUNCTION_ATTRIBUTES
    | UNSAFE_METHOD_ATTRIBUTES
    | UNSAFE_GENERATOR_ATTRIBUTES
    | UNSAFE_COROUTINE_ATTRIBUTES
    | UNSAFE_ASYNC_GENERATOR_ATTRIBUTES
)


class PromptError(InputError):
    """A prompt template failed to render with the values of a real call; the message names the template."""


@dataclass(frozen=True)
class PromptTemplate:
    """The source of one template and where it came from (`origin` None = shipped with mass-ops)."""

    name: str
    source: str
    origin: Path | None = None

    @property
    def sha256(self) -> str:
        """SHA-256 of the template file's bytes."""
        return hashlib.sha256(self.source.encode("utf-8")).hexdigest()

    @property
    def where(self) -> str:
        """The template as a message names it: its override file, or ``shipped <name>``."""
        return str(self.origin) if self.origin is not None else f"shipped {self.name}"


class PromptSet:
    """One complete set of prompt templates (the shipped ones, some possibly replaced) and their Jinja2 setup."""

    def __init__(self, templates: Mapping[str, PromptTemplate]) -> None:
        missing = sorted(set(TEMPLATES) - set(templates))
        if missing:
            raise ValueError(f"prompt set lacks templates {missing}")
        self.templates = dict(templates)
        # The sandbox, immutable: a template may read its variables but neither reach Python internals nor mutate
        # the values it was given (the same objects go on to the next call).
        self._env = ImmutableSandboxedEnvironment(
            loader=jinja2.FunctionLoader(self._source),
            undefined=jinja2.StrictUndefined,
            autoescape=False,  # plain text for a model, never HTML
            trim_blocks=True,
            lstrip_blocks=True,
            keep_trailing_newline=False,
            auto_reload=False,
        )

    def _source(self, name: str) -> tuple[str, str, Callable[[], bool]] | None:
        template = self.templates.get(name)
        return None if template is None else (template.source, template.where, lambda: True)

    @property
    def names(self) -> list[str]:
        return sorted(self.templates)

    @property
    def overridden(self) -> list[str]:
        """Names of the templates that an override folder replaced."""
        return [name for name in self.names if self.templates[name].origin is not None]

    def digests(self) -> dict[str, str]:
        """Template name → SHA-256, what a cycle row records."""
        return {name: self.templates[name].sha256 for name in self.names}

    def render(self, name: str, /, **variables: Any) -> str:
        """The text of template `name` with `variables`; `PromptError` (one line naming the template) on failure."""
        try:
            text = self._env.get_template(name).render(variables)
        except jinja2.TemplateError as exc:
            raise PromptError(f"prompt template {self._where(name)}: {_one_line(exc)}") from None
        note_render(name, variables, text)  # what a recorded message was made of (`mass-ops prompts check`)
        return text

    def macro(self, name: str, macro: str) -> Callable[..., str]:
        """A macro of template `name` (e.g. a part of the optimizer message) as a function returning text."""
        try:
            function = getattr(self._env.get_template(name).module, macro)
        except jinja2.TemplateError as exc:
            raise PromptError(f"prompt template {self._where(name)}: {_one_line(exc)}") from None
        except AttributeError:
            raise PromptError(f"prompt template {self._where(name)} defines no macro {macro!r}") from None

        def call(*args: Any) -> str:
            try:
                return str(function(*args))
            except jinja2.TemplateError as exc:
                raise PromptError(f"prompt template {self._where(name)}: macro {macro}: {_one_line(exc)}") from None

        return call

    def _where(self, name: str) -> str:
        template = self.templates.get(name)
        return template.where if template is not None else name

    def check(self) -> None:
        """Parse every template, refuse variables its spec does not provide, check the macros callers use, and
        render it with every sample; `ConfigError` with one line naming the first broken template."""
        for name in self.names:
            spec, template = TEMPLATES[name], self.templates[name]
            problem = self._problem(name, spec.variables, spec.macros, spec.samples)
            if problem is not None:
                raise ConfigError([f"config: prompts: {template.where}: {problem}"])

    def _problem(
        self, name: str, known: frozenset[str], macros: tuple[str, ...], samples: tuple[Mapping[str, Any], ...]
    ) -> str | None:
        try:
            tree = self._env.parse(self.templates[name].source)
        except jinja2.TemplateSyntaxError as exc:
            return f"line {exc.lineno}: {_one_line(exc)}"
        unknown = sorted(meta.find_undeclared_variables(tree) - known)
        if unknown:
            allowed = ", ".join(sorted(known)) or "none"
            return f"uses unknown variable(s) {', '.join(unknown)} (this template gets: {allowed})"
        unsafe = unsafe_access(tree)
        if unsafe is not None:
            return unsafe
        try:
            if macros:  # a macro library renders with no variables, so its module can be built
                module = self._env.get_template(name).module
                absent = [macro for macro in macros if not callable(getattr(module, macro, None))]
                if absent:
                    return f"defines no macro(s) {', '.join(absent)} (mass-ops calls them)"
            for sample in samples:
                self._env.get_template(name).render(sample)
        except jinja2.TemplateError as exc:
            return f"does not render: {_one_line(exc)}"
        except Exception as exc:  # a template is user code: any error of its expressions is a broken template
            return f"does not render: {type(exc).__name__}: {_one_line(exc)}"
        return None


def unsafe_access(tree: nodes.Template) -> str | None:
    """The first attribute access of a parsed template that the sandbox would refuse (`x.__class__`,
    `x['__globals__']`, `x|attr('__mro__')`), as a problem line naming it and its line; None when there is none.

    Static, so it covers branches that no sample renders; a name built at run time ('__cla' ~ 'ss__') is not seen
    here but still raises in the sandbox."""
    for node in tree.find_all((nodes.Getattr, nodes.Getitem, nodes.Filter)):
        if isinstance(node, nodes.Getattr):
            name: object = node.attr
        elif isinstance(node, nodes.Getitem):
            name = node.arg.value if isinstance(node.arg, nodes.Const) else None
        elif (
            isinstance(node, nodes.Filter)
            and node.name == "attr"
            and node.args
            and isinstance(node.args[0], nodes.Const)
        ):
            name = node.args[0].value
        else:
            continue
        if isinstance(name, str) and (name.startswith("_") or name in UNSAFE_ATTRIBUTES):
            return f"line {node.lineno}: accesses the unsafe attribute {name!r} (templates render in a sandbox)"
    return None


def _one_line(exc: BaseException) -> str:
    text = getattr(exc, "message", None) or str(exc)
    return " ".join(str(text).split())


def _read_template(path: Path) -> str:
    size = path.stat().st_size
    if size > MAX_TEMPLATE_BYTES:
        raise ConfigError([f"config: prompts.dir: {path} is {size} bytes, over the limit of {MAX_TEMPLATE_BYTES}"])
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"config: prompts.dir: {path} is not UTF-8 text (byte {exc.start})"]) from None


@cache
def shipped_prompts() -> PromptSet:
    """The templates that ship with mass-ops."""
    return PromptSet({name: PromptTemplate(name, _read_template(TEMPLATE_DIR / name)) for name in TEMPLATES})


def load_prompts(folder: str | Path | None) -> PromptSet:
    """The shipped templates with those in `folder` (if any) replacing them by file name.

    Every entry of the folder not starting with '.' must be a known template file: an unknown name (a typo such
    as ``judge-system.j2``) would otherwise be ignored in silence. Problems are `ConfigError`s of one line.
    """
    shipped = shipped_prompts()
    if folder is None:
        return shipped
    root = Path(folder)
    if not root.is_dir():
        raise ConfigError([f"config: prompts.dir: {root} is not a folder"])
    entries = sorted(entry for entry in root.iterdir() if not entry.name.startswith("."))
    unknown = [entry.name for entry in entries if entry.name not in TEMPLATES or not entry.is_file()]
    if unknown:
        known = ", ".join(sorted(TEMPLATES))
        raise ConfigError([f"config: prompts.dir: {root} holds unknown template file(s) {unknown}; known: {known}"])
    templates = dict(shipped.templates)
    for entry in entries:
        templates[entry.name] = PromptTemplate(entry.name, _read_template(entry), entry)
    return PromptSet(templates)


def check_templates(config: CycleConfig) -> PromptSet:
    """The config's prompt templates (shipped, replaced by ``prompts.dir``), each parsed and rendered with sample
    variables; `ConfigError` with one line naming the template and what is wrong."""
    prompts = load_prompts(config.prompts.dir)
    prompts.check()
    return prompts


def check_recorded(prompts: PromptSet, recorded: Mapping[str, str] | None, cycle: str) -> None:
    """Refuse templates that differ from those the cycle recorded when it was opened (a later stage would otherwise
    mix two wordings in one cycle); a cycle that recorded none is not checked."""
    if recorded is None:
        return
    current = prompts.digests()
    changed = sorted(name for name in set(current) | set(recorded) if current.get(name) != recorded.get(name))
    if changed:
        raise ConfigError(
            [
                f"config: prompts: template(s) {', '.join(changed)} differ from those cycle {cycle!r} was opened with "
                "(SHA-256 on its cycle row); restore them or run the changed prompts under a new cycle name"
            ]
        )

"""From a preset name or a YAML/JSON file to a validated `CycleConfig`.

Order: read (guarded: size, UTF-8, depth, no duplicate keys, no YAML aliases) → `--set a.b=c` overrides →
MASS_METADATA_URL / MASS_ARTIFACT_URL → validation. Every failure is a `ConfigError` with one line per problem.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from mass_ops.config.cycle import CycleConfig
from mass_ops.config.section import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, ConfigError, validation_problems
from mass_ops.errors import first_line

PRESETS_DIR = Path(__file__).parent.parent / "presets"
PRESET_NAMES = ("paper", "cycle2", "demo")
METADATA_URL_ENV = "MASS_METADATA_URL"
ARTIFACT_URL_ENV = "MASS_ARTIFACT_URL"


def preset_path(name: str) -> Path:
    """Path of a shipped preset file."""
    return PRESETS_DIR / f"{name}.yaml"


class _RefusedInput(Exception):
    """A config text that parses but is refused (alias, duplicate key, too deep); the message is the reason."""


class _StrictYAMLLoader(yaml.SafeLoader):
    """A safe loader that refuses anchors and aliases (an alias bomb expands 0.5 KB into gigabytes), duplicate keys
    (YAML keeps the last one silently) and nesting deeper than `MAX_CONFIG_DEPTH` (the composer recurses)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()  # type: ignore[no-untyped-call]  # types-PyYAML leaves Parser.peek_event unannotated
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent):
            raise _RefusedInput(f"line {line}: YAML aliases (*{event.anchor}) are not allowed")
        if getattr(event, "anchor", None) is not None:
            raise _RefusedInput(f"line {line}: YAML anchors (&{event.anchor}) are not allowed")
        self._depth += 1
        if self._depth > MAX_CONFIG_DEPTH:
            raise _RefusedInput(f"line {line}: nested deeper than {MAX_CONFIG_DEPTH} levels")
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[tuple[str, str]] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key = (key_node.tag, key_node.value)
                if key in seen:
                    raise _RefusedInput(f"line {key_node.start_mark.line + 1}: duplicate key {key_node.value!r}")
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str) -> Any:
    loader = _StrictYAMLLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _RefusedInput(f"duplicate key {key!r}")
        result[key] = value
    return result


def _check_depth(value: Any, where: str) -> None:
    """Refuse data nested deeper than `MAX_CONFIG_DEPTH` (checked without recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth > MAX_CONFIG_DEPTH:
                raise ConfigError([f"config: {where}: nested deeper than {MAX_CONFIG_DEPTH} levels"])
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)


def parse_config_text(text: str, kind: Literal["yaml", "json"]) -> Any:
    """Parse config text with every guard (no aliases, no duplicate keys, bounded depth); raise `_RefusedInput`,
    `ValueError` (which includes JSON and integer-size errors) or `yaml.YAMLError` on bad input."""
    try:
        if kind == "json":
            return json.loads(text, object_pairs_hook=_json_object)
        return _load_yaml(text)
    except RecursionError:
        raise _RefusedInput(f"nested deeper than {MAX_CONFIG_DEPTH} levels") from None


def _short(text: str, limit: int = 80) -> str:
    """`repr` of user text cut to `limit` characters, so an error about a huge value stays a short line."""
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def read_config_source(source: str | Path) -> dict[str, Any]:
    """Read a preset name or a YAML/JSON file into a plain mapping (no validation yet).

    The file must be UTF-8, at most `MAX_CONFIG_BYTES`, nested at most `MAX_CONFIG_DEPTH` levels, without duplicate
    keys and (YAML) without anchors or aliases; anything else is a `ConfigError`.
    """
    text_source = str(source)
    path = preset_path(text_source) if text_source in PRESET_NAMES else Path(text_source)
    if not path.is_file():
        presets = ", ".join(PRESET_NAMES)
        raise ConfigError([f"config: {_short(text_source)}: no such preset or file (presets: {presets})"])
    kind: Literal["yaml", "json"] = "json" if path.suffix == ".json" else "yaml"
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError([f"config: {path}: cannot read ({exc.strerror or exc})"]) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError([f"config: {path}: larger than {MAX_CONFIG_BYTES} bytes"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"config: {path}: not UTF-8 text (invalid byte at offset {exc.start})"]) from None
    try:
        data = parse_config_text(text, kind)
    except _RefusedInput as exc:
        raise ConfigError([f"config: {path}: {exc}"]) from None
    except (ValueError, yaml.YAMLError) as exc:
        label = path.suffix.lstrip(".") or "YAML"
        raise ConfigError([f"config: {path}: not valid {label}: {first_line(exc)}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"config: {path}: the top level must be a mapping"])
    _check_depth(data, str(path))
    return data


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply `a.b=c` overrides; values are parsed as YAML scalars/lists (`3`, `true`, `[51, 53]`, `null`).

    Values get the same guards as config files (no aliases, no duplicate keys, bounded depth); a value that is not
    YAML at all is taken as a plain string.
    """
    _check_depth(data, "config")
    result: dict[str, Any] = json.loads(json.dumps(data))
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        parts = key.split(".")
        if not sep or not key or any(not part for part in parts):
            problems.append(f"--set {_short(item)}: expected KEY.PATH=VALUE")
            continue
        if len(parts) > MAX_CONFIG_DEPTH:
            problems.append(f"--set {_short(item)}: key nested deeper than {MAX_CONFIG_DEPTH} levels")
            continue
        try:
            value = parse_config_text(raw, "yaml") if raw.strip() else ""
        except _RefusedInput as exc:
            problems.append(f"--set {_short(item)}: {exc}")
            continue
        except ValueError as exc:
            problems.append(f"--set {_short(item)}: {first_line(exc)}")
            continue
        except yaml.YAMLError:
            value = raw
        node = result
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                problems.append(f"--set {_short(item)}: {part} is not a section")
                break
            node = child
        else:
            node[parts[-1]] = value
    if problems:
        raise ConfigError(problems)
    _check_depth(result, "--set")
    return result


def apply_environment(data: dict[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """MASS_METADATA_URL and MASS_ARTIFACT_URL override the storage URLs of any config."""
    env = os.environ if environ is None else environ
    result = dict(data)
    storage = dict(result.get("storage") or {})
    if env.get(METADATA_URL_ENV):
        storage["metadata_url"] = env[METADATA_URL_ENV]
    if env.get(ARTIFACT_URL_ENV):
        storage["artifact_url"] = env[ARTIFACT_URL_ENV]
    if storage:
        result["storage"] = storage
    return result


def format_validation_error(exc: ValidationError) -> list[str]:
    """One line per problem: `config: <dotted field>: <rule>`."""
    return [f"config: {problem}" for problem in validation_problems(exc)]


def validate_config(data: Mapping[str, Any]) -> CycleConfig:
    """Validate a mapping into a frozen `CycleConfig`, or raise `ConfigError` listing every problem."""
    try:
        return CycleConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def load_config(
    source: str | Path,
    overrides: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
) -> CycleConfig:
    """Preset name or file → overrides → environment → validated config."""
    data = read_config_source(source)
    data = apply_overrides(data, overrides)
    data = apply_environment(data, environ)
    return validate_config(data)


def config_json_schema() -> dict[str, Any]:
    """JSON Schema of the cycle config (drives the Airflow trigger form)."""
    return CycleConfig.model_json_schema()

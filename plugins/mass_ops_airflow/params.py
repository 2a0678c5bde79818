"""Trigger-form params of a cycle, generated from the config's JSON Schema, and the config rebuilt from them.

Contract: each knob's Param carries its config field's JSON Schema, made nullable (empty means "as the preset
says"); `build_config` applies the values as `--set` overrides and validates the whole config, so a bad value fails
the first task with one line per problem. Every task rebuilds the config from params (never through XCom), so each
task, retry or cleared task sees the configuration the run was triggered with. A trigger may set only the experiment
settings in `TRIGGER_SETTABLE` and names a preset only by NAME (`trigger_preset`); images, secrets, storage,
endpoints and the like come from the deployment alone. The knob schemas are generated into `form_schema.json`
(`python -m mass_ops_airflow.params` rewrites it). Trust model and rationale: docs/operations.md
(`mass_ops_airflow.params`).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

if TYPE_CHECKING:
    from mass_ops.config import CycleConfig

log = logging.getLogger(__name__)

DEFAULT_PRESET_ENV = "MASS_DEFAULT_PRESET"
# The estimate page of the plugin's app (`report_app`), as the API server serves it.
ESTIMATE_PATH = "/mass-ops/estimate"
# Where the deployment registers presets of its own, `<name>.yaml` each (the chart mounts its presets ConfigMap here).
PRESETS_DIR_ENV = "MASS_PRESETS_DIR"
DEFAULT_PRESETS_DIR = "/etc/mass-ops/presets"
_PRESET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}\Z")
FORM_SCHEMA_FILE = Path(__file__).with_name("form_schema.json")
# RHI steps are laid out at parse time, one task per version: the deepest search a run may ask for.
MAX_SEARCH_ITERATIONS = 11
# Seed bases move by this much from one cycle to the next (paper → cycle2: 450000 → 1450000, 710000 → 1710000).
_OVERRIDE = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*=.*$"


@dataclass(frozen=True)
class Knob:
    """A config field exposed in the trigger form under a short param name, with the title the form shows."""

    param: str
    path: str
    section: str
    title: str


# The knobs an operator sets most; every other key goes through `overrides`. Each Param is copied into every task at
# parse time, so this list is kept to what the trigger form is for.
KNOBS: tuple[Knob, ...] = (
    Knob("cycle_name", "name", "Cycle", "Cycle name"),
    Knob("generation", "generation", "Cycle", "Generation (k of L(k))"),
    Knob("served_name", "models.served_name", "Cycle", "Served model name"),
    Knob("parent_model", "models.parent_bf16", "Cycle", "Parent model (BF16)"),
    Knob("compute_backend", "compute.backend", "Compute", "Compute backend"),
    Knob("max_concurrent_requests", "inference.max_concurrent_requests", "Compute", "Concurrent LLM requests"),
    Knob("train_tasks", "tasks.train", "Tasks", "Training tasks"),
    Knob("test_tasks", "tasks.test", "Tasks", "Test tasks"),
    Knob("search_iterations", "search.iterations", "Search and collection", "Search iterations"),
    Knob("candidates", "collection.candidates", "Search and collection", "Candidates per task"),
    Knob("training_steps", "training.steps", "Training", "Training steps"),
    Knob("learning_rate", "training.lr", "Training", "Learning rate"),
    Knob("lora_r", "training.lora_r", "Training", "LoRA rank"),
    Knob("training_nnodes", "training.nnodes", "Training", "Training nodes"),
    Knob("gpus_per_node", "training.gpus_per_node", "Training", "GPUs per node"),
    Knob("rollout_count", "evaluation.rollout_count", "Evaluation", "Evaluation rollouts"),
    Knob("regression_threshold", "evaluation.regression_threshold", "Evaluation", "Regression threshold"),
)
KNOB_BY_PARAM = {k.param: k for k in KNOBS}
# Knobs whose running value the deployment may set before the preset (the chart's cluster settings choose the
# backend): the form leaves them empty, so an explicit choice is never mistaken for "as shown".
DEPLOYMENT_KNOBS = frozenset({"compute_backend"})
# Pydantic writes Field bounds of custom-validated floats under these names; JSON Schema spells them differently.
_BOUND_NAMES = {"gt": "exclusiveMinimum", "ge": "minimum", "lt": "exclusiveMaximum", "le": "maximum"}
_SCHEMA_KEYS = {
    "type", "enum", "items", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength",
    "maxLength", "pattern", "anyOf", "minItems", "maxItems",
}  # fmt: skip


class ParamsError(ValueError):
    """Params that cannot describe a run (unknown knob, a field the schema lacks, a key only the deployment sets)."""


# The config paths a trigger may set, with everything below them: the experiment's knobs (which model, which tasks,
# how much search, collection, ranking, training and evaluation, budgets and prices, episode limits). A path not
# listed is the deployment's: storage, endpoints and key-variable names (`inference.backend/endpoint/api_key_env`,
# `inference.server`), external judges (a judge names a URL and a key variable), `prompts.dir` and a catalogue folder
# (server paths), `compute.local_inference`, `compute.kubernetes.*` (images, namespace, node selectors, ...) and every
# `runtime.*` sandbox or device setting. Being an allowlist, a config field added later is the deployment's until it
# is listed here. Every knob of the trigger form is one of these paths (a test keeps it so).
TRIGGER_SETTABLE: tuple[str, ...] = (
    "name",
    "preset",
    "generation",
    "models.served_name",
    "models.parent_bf16",
    "models.fp8_reference",
    "models.next_bf16",
    "models.next_fp8",
    "inference.context_window_tokens",
    "inference.episode_max_output_tokens",
    "inference.max_output_tokens",
    "inference.context_safety_tokens",
    "inference.reasoning_effort",
    "inference.sampling",
    "inference.max_concurrent_requests",
    "inference.request_timeout_s",
    "tasks.catalogue",
    "tasks.train_candidates",
    "tasks.train",
    "tasks.test",
    "tasks.excluded",
    "search",
    "judge",
    "collection",
    "ranking",
    "training",
    "export",
    "evaluation.rollout_count",
    "evaluation.rollout_seed_base",
    "evaluation.tasks",
    "evaluation.judge_seeds",
    "evaluation.swap_consistent",
    "evaluation.regression_threshold",
    "compute.backend",
    "runtime.http_response_timeout_ms",
    "runtime.shell_timeout_ms",
    "runtime.stream_idle_timeout_ms",
    "runtime.episode_wall_clock_s",
    "runtime.max_infra_attempts",
    "runtime.thread_limit",
    "budgets",
    "prices",
)
# Settable paths whose value a trigger may choose only within the deployment: the catalogue by name (a folder is a
# server path), model locations in the deployment's artifact store (an absolute path or another bucket would make
# training read, and export write, wherever the caller says).
_MODEL_LOCATIONS = ("models.parent_bf16", "models.fp8_reference", "models.next_bf16", "models.next_fp8")


def trigger_override_problem(override: str) -> str | None:
    """Why a trigger may not apply the `path=value` override, as one line naming the key; None when it may (model
    locations are checked once the store is known: `model_location_problem`)."""
    from mass_ops.config import parse_config_text

    path, _, raw = override.partition("=")
    if not any(path == allowed or path.startswith(f"{allowed}.") for allowed in TRIGGER_SETTABLE):
        return (
            f"params: {path[:120]} is set by the deployment, not by a trigger (a trigger sets experiment settings "
            "only: mass_ops_airflow.params.TRIGGER_SETTABLE)"
        )
    if path == "tasks.catalogue":
        try:  # read as `apply_overrides` will read it, with the same guards
            value = parse_config_text(raw, "yaml") if raw.strip() else ""
        except Exception:  # not YAML at all: `apply_overrides` takes it as text
            value = raw
        if value != "builtin":
            return (
                "params: tasks.catalogue: may only be 'builtin' from a trigger (a catalogue folder is the "
                "deployment's: its preset file)"
            )
    return None


def model_location_problem(location: str, artifact_url: str) -> str | None:
    """Why a trigger may not point a model at `location`, or None: a key in the artifact store (`models/L1-bf16`)
    or a location under the store's own root (`s3://bucket/prefix/...`, a folder below a local store) is fine."""
    parts = location.replace("\\", "/").split("/")
    if ".." not in parts and location.strip():
        if "://" not in location and not location.startswith(("/", "~", "\\")):
            return None
        if artifact_url.startswith("s3://"):
            roots = [artifact_url.rstrip("/")]
        else:
            local = Path(artifact_url.removeprefix("file://")).expanduser().resolve()
            roots = [str(local), local.as_uri()]
        if any(location.startswith(f"{root}/") for root in roots):
            return None
    return f"must be a key in the deployment's artifact store (like models/L1-bf16) or lie under {artifact_url}"


def trigger_preset(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The config source of the preset a trigger names: a shipped preset, a deployment-registered one
    (`$MASS_PRESETS_DIR/<name>.yaml`, default /etc/mass-ops/presets) or the deployment's own default
    (`$MASS_DEFAULT_PRESET`, which may be a file). Any other value — a path of the caller's choosing — is a
    `ParamsError` of one line."""
    from mass_ops.config import PRESET_NAMES

    env = os.environ if environ is None else environ
    if name in PRESET_NAMES or (env.get(DEFAULT_PRESET_ENV) and name == env[DEFAULT_PRESET_ENV]):
        return name
    folder = Path(env.get(PRESETS_DIR_ENV) or DEFAULT_PRESETS_DIR)
    if _PRESET_NAME.fullmatch(name) and (folder / f"{name}.yaml").is_file():
        return str(folder / f"{name}.yaml")
    shown = name if len(name) <= 80 else name[:77] + "..."
    raise ParamsError(
        f"params: preset {shown!r} is not a preset name (shipped: {', '.join(PRESET_NAMES)}; the deployment "
        f"registers others as ${PRESETS_DIR_ENV}/<name>.yaml); a trigger cannot name a file"
    )


def _resolve(schema: Mapping[str, Any], node: Mapping[str, Any]) -> dict[str, Any]:
    """Inline `$ref`s into `#/$defs/...` (recursively) so a field schema stands alone."""
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        return _resolve(schema, schema["$defs"][name])
    out: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, Mapping):
            out[key] = _resolve(schema, value)
        elif isinstance(value, list):
            out[key] = [_resolve(schema, v) if isinstance(v, Mapping) else v for v in value]
        else:
            out[key] = value
    return out


def field_schema(path: str, schema: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON Schema of config field `path` (dotted), `$ref`s resolved, bounds in standard spelling."""
    from mass_ops.config import config_json_schema

    root = schema or config_json_schema()
    node: Mapping[str, Any] = root
    for part in path.split("."):
        node = _resolve(root, node)
        properties = node.get("properties", {})
        if part not in properties:
            raise ParamsError(f"params: the config has no field {path!r}")
        node = properties[part]
    resolved = _resolve(root, node)
    return _standard_bounds(resolved)


def _standard_bounds(node: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in node.items():
        key = _BOUND_NAMES.get(key, key)
        if isinstance(value, dict):
            value = _standard_bounds(value)
        elif isinstance(value, list):
            value = [_standard_bounds(v) if isinstance(v, dict) else v for v in value]
        out[key] = value
    return out


def nullable(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The same schema accepting null too (an empty form field means "keep the preset's value")."""
    keep = {k: copy.deepcopy(v) for k, v in schema.items() if k in _SCHEMA_KEYS}
    if "anyOf" in keep:
        options = [o for o in keep["anyOf"] if o != {"type": "null"}]
        return {"anyOf": [*options, {"type": "null"}]}
    kind = keep.get("type")
    if isinstance(kind, str):
        keep["type"] = [kind, "null"]
    elif isinstance(kind, list) and "null" not in kind:
        keep["type"] = [*kind, "null"]
    if "enum" in keep and None not in keep["enum"]:
        keep["enum"] = [*keep["enum"], None]
    return keep


def default_preset() -> str:
    """The form's default preset: `$MASS_DEFAULT_PRESET`, else `demo` (the laptop profile)."""
    return os.environ.get(DEFAULT_PRESET_ENV) or "demo"


def generate_form_schema() -> dict[str, Any]:
    """Presets and the nullable JSON Schema of every knob, derived from the config models (slow: pydantic)."""
    from mass_ops.config import PRESET_NAMES, config_json_schema

    schema = config_json_schema()
    knobs: dict[str, dict[str, Any]] = {}
    for knob in KNOBS:
        field = field_schema(knob.path, schema)
        text = _without_reference(str(field.get("description", field.get("title", knob.path))))
        knobs[knob.param] = {**nullable(field), "title": knob.title, "description": text, "section": knob.section}
    values = {name: preset_knob_values(name) for name in PRESET_NAMES}
    return {"presets": list(PRESET_NAMES), "knobs": knobs, "preset_values": values}


def _without_reference(text: str) -> str:
    """A field's description without the paper's value it quotes (the form states the preset's value instead)."""
    text = re.sub(r"\s*\((?:the )?reference [^)]*\)", "", text.strip().rstrip("."))
    text = re.sub(r"\.\s*Reference: [^;]*?(?:;\s*(at most \d+))?$", lambda m: f"; {m[1]}" if m[1] else "", text)
    return re.sub(r"\.\s*Default \S+$", "", text)


def preset_knob_values(preset: str) -> dict[str, Any]:
    """Each knob's value in `preset` (a name `trigger_preset` accepts) once validated, defaults filled in; {} when
    the preset cannot be read or validated here (the form then leaves its knobs empty: the run still reports it)."""
    from mass_ops.config import read_config_source, validate_config

    try:
        dumped = validate_config(read_config_source(trigger_preset(preset))).model_dump(mode="json")
    except Exception as exc:  # never fail a DAG parse over the form's defaults
        log.warning("params: the trigger form cannot show preset %s's values: %s", preset[:120], str(exc)[:200])
        return {}
    values: dict[str, Any] = {}
    for knob in KNOBS:
        node: Any = dumped
        for part in knob.path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        values[knob.param] = node
    return values


@cache
def form_preset_values(preset: str) -> dict[str, Any]:
    """The knob values the form shows for `preset`: the shipped ones from `form_schema.json`, else read once per
    process (the deployment's own default, a file)."""
    shipped = form_schema().get("preset_values", {})
    return dict(shipped[preset]) if preset in shipped else preset_knob_values(preset)


def _shown(value: Any) -> str:
    """A knob value as the help text states it."""
    if value is None or value == []:
        return "none"
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return str(value)


def knob_param_spec(knob: Knob, spec: Mapping[str, Any], preset: str, value: Any) -> tuple[Any, dict[str, Any]]:
    """The default and the Param schema of `knob` in a form whose preset is `preset` (its value there: `value`):
    the preset's value as the default (an empty list shows as an empty field), its value stated in the help text and
    a dropdown's empty choice labelled in words."""
    out = copy.deepcopy(dict(spec))
    label = preset if len(preset) <= 40 else "default"
    out["description"] = (
        f"{out.get('description', knob.path)}. The {label} preset sets {_shown(value)}; empty = the chosen preset's "
        f"value (config: {knob.path})."
    )
    if "enum" in out:  # the UI labels each choice by values_display, and its empty choice by the "null" entry
        out["values_display"] = {**{str(v): str(v) for v in out["enum"] if v is not None}, "null": "the preset's value"}
    if knob.param in DEPLOYMENT_KNOBS:
        out["description"] += " The deployment's cluster settings, where it has them, come before the preset."
        return None, out
    return (None if value == [] else value), out


def write_form_schema(path: Path = FORM_SCHEMA_FILE) -> Path:
    """Regenerate `form_schema.json` (atomically) from the config models."""
    text = json.dumps(generate_form_schema(), indent=2, sort_keys=True) + "\n"
    temp = path.with_suffix(".json.tmp")
    temp.write_text(text, encoding="utf-8")
    os.replace(temp, path)
    return path


@cache
def form_schema() -> dict[str, Any]:
    """The generated form schema (from the shipped file; generated on the spot when the file is missing)."""
    if FORM_SCHEMA_FILE.is_file():
        return json.loads(FORM_SCHEMA_FILE.read_text(encoding="utf-8"))
    return generate_form_schema()


NIGHTLY_KNOBS = ("compute_backend", "max_concurrent_requests", "rollout_count", "regression_threshold")
# The nightly DAG's params that choose its benchmark slice, not the config (`mass_ops.stages.nightly`).
NIGHTLY_RUN_PARAMS = ("benchmark_slice", "benchmark_slice_instances", "benchmark_data_dir")
NIGHTLY_SLICE_INSTANCES = 5


def nightly_slice_params() -> dict[str, Any]:
    """The nightly DAG's benchmark-slice params: benchmark names (empty: no slice), the first N instances of each,
    and the dataset folder. The names are checked by the DAG's first task against the suite (one line when unknown),
    so the suite is listed in one place."""
    from airflow.sdk import Param

    return {
        "benchmark_slice": Param(
            [],
            type="array",
            items={"type": "string", "minLength": 1},
            title="Benchmark slice",
            description="Public benchmarks to run a few instances of tonight, one trial, on every served generation "
            "(any of tb2, swe, ds, asta); empty = no slice.",
            section="Benchmark slice",
        ),
        "benchmark_slice_instances": Param(
            NIGHTLY_SLICE_INSTANCES,
            type="integer",
            minimum=1,
            title="Benchmark slice instances",
            description="The first N instances of each slice benchmark.",
            section="Benchmark slice",
        ),
        "benchmark_data_dir": Param(
            None,
            type=["null", "string"],
            title="Benchmark data dir",
            description="The folder with one dataset subfolder per benchmark (empty: $MASS_BENCHMARK_DATA); nothing "
            "is downloaded.",
            section="Benchmark slice",
        ),
    }


def cycle_params(*, preset: str | None = None, knobs: Sequence[str] | None = None) -> dict[str, Any]:
    """The `params` of the cycle DAG: preset, the knobs (all by default; nullable, schema-checked), overrides and
    auto_continue (cycle DAG only, i.e. when all knobs are exposed)."""
    from airflow.sdk import Param

    wanted = set(KNOB_BY_PARAM) if knobs is None else set(knobs)
    unknown = sorted(wanted - set(KNOB_BY_PARAM))
    if unknown:
        raise ParamsError(f"params: unknown knobs {unknown}")
    schema = form_schema()
    presets = schema["presets"]
    params: dict[str, Any] = {
        "preset": Param(
            preset or default_preset(),
            type=["string", "null"],
            minLength=1,
            title="Preset",
            description=f"A shipped preset ({', '.join(presets)}) or one the deployment registers, by name. The "
            "knobs below show this default's values; with another preset, a knob left at its shown value takes "
            "that preset's value.",
            examples=list(presets),
            section="Cycle",
        ),
    }
    shown_preset = preset or default_preset()
    values = form_preset_values(shown_preset)
    for knob in KNOBS:
        if knob.param in wanted:
            default, spec = knob_param_spec(knob, schema["knobs"][knob.param], shown_preset, values.get(knob.param))
            params[knob.param] = Param(default, **spec)
    params["overrides"] = Param(
        [],
        type=["array", "null"],
        items={"type": "string", "pattern": _OVERRIDE},
        title="Overrides",
        description="More experiment settings as KEY.PATH=VALUE lines (values parsed as YAML), applied after the "
        "knobs; images, endpoints, storage, secrets and sandbox settings are the deployment's and refused here.",
        section="Advanced",
    )
    if knobs is not None:
        return params
    params["auto_continue"] = Param(
        False,
        type=["boolean", "null"],
        title="Auto continue",
        description="When the new generation is registered and evaluated, trigger the next cycle on it.",
        section="Advanced",
    )
    estimate = f"{ESTIMATE_PATH}?preset={quote(str(preset or default_preset()), safe='')}"
    # Markdown only: Airflow's form shows a plain `description` when there is one, and renders `description_md`
    # (here with the link to the estimate page) only without it.
    params["allow_over_budget"] = Param(
        False,
        type=["boolean", "null"],
        title="Allow over budget",
        description_md=(
            "Start the run even when its cost estimate exceeds `budgets.cycle_cost_usd` or `budgets.cycle_tokens`. "
            f"[Open the estimate per stage]({estimate}) for the preset; add each changed knob as `&knob=value` "
            "and each override as `&set=key=value` to the page's address."
        ),
        section="Advanced",
    )
    return params


def knob_overrides(params: Mapping[str, Any]) -> list[str]:
    """`path=value` overrides of the knobs set in `params` (values as JSON, which the YAML parser reads back)."""
    overrides = []
    for knob in KNOBS:
        value = params.get(knob.param)
        if value is not None:
            overrides.append(f"{knob.path}={json.dumps(value)}")
    return overrides


def _deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(dict(base))
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def cluster_compute_section(settings_dir: str | Path | None) -> dict[str, Any]:
    """The `compute` section the Helm chart renders for this namespace (`kubernetes.yaml`), or {} off-cluster."""
    import yaml

    from mass_ops.config import ConfigError

    if settings_dir is None:
        return {}
    path = Path(settings_dir) / "kubernetes.yaml"
    if not path.is_file():
        return {}
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    compute = data.get("compute") if isinstance(data, dict) else None
    if not isinstance(compute, dict):
        raise ConfigError([f"config: compute: {path} does not hold a compute section"])
    return compute


# The cycle DAG's params that steer the run, not the config (build_config accepts and ignores them).
CYCLE_RUN_PARAMS = ("auto_continue", "allow_over_budget")
# Accepted and ignored likewise: the nightly DAG's server and report operators build the config from its whole
# params; its own tasks strip them with config_params.
IGNORED_RUN_PARAMS = (*CYCLE_RUN_PARAMS, *NIGHTLY_RUN_PARAMS)


def config_params(params: Mapping[str, Any] | None, run_params: Sequence[str]) -> dict[str, Any]:
    """`params` without a DAG's own run params (`run_params`: what the run does — a generation to benchmark, a
    benchmark slice — rather than how the cycle is configured): what `build_config` reads. A DAG declares its run
    params once and every task strips them with this, so `build_config` keeps refusing any other unknown param
    (a typo in a trigger's conf fails in one line instead of being ignored)."""
    return {key: value for key, value in (params or {}).items() if key not in set(run_params)}


def build_config(
    params: Mapping[str, Any],
    *,
    storage: Mapping[str, str] | None = None,
    settings_dir: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> CycleConfig:
    """The run's validated config: preset → cluster compute settings → knobs → overrides → environment → storage.

    Knobs and overrides come from the trigger, so each must be a `TRIGGER_SETTABLE` path and the preset a name
    (`trigger_preset`); anything else is a `ParamsError` of one line before any file is read. `storage` (from the
    Airflow connections, see `hooks`) wins over MASS_METADATA_URL / MASS_ARTIFACT_URL. With the Kubernetes backend
    the endpoint becomes the in-cluster Service of the cycle's inference server.
    """
    from mass_ops.compute.backend import backend_for
    from mass_ops.compute.kubernetes import settings_dir as default_settings_dir
    from mass_ops.config import ConfigError, apply_environment, apply_overrides, read_config_source, validate_config

    unknown = sorted(set(params) - set(KNOB_BY_PARAM) - {"preset", "overrides", *IGNORED_RUN_PARAMS})
    if unknown:
        raise ParamsError(
            f"params: unknown {unknown}; knobs are {sorted(KNOB_BY_PARAM)} (a DAG's own run params are stripped with "
            "config_params before the config is built)"
        )
    params = _unshown_knobs(params)
    extra = as_overrides(params.get("overrides") or [])
    from_trigger = [*knob_overrides(params), *extra]
    refused = next(filter(None, map(trigger_override_problem, from_trigger)), None)
    if refused is not None:
        raise ParamsError(refused)
    preset = trigger_preset(str(params.get("preset") or default_preset()))
    data = read_config_source(preset)
    cluster = cluster_compute_section(settings_dir if settings_dir is not None else default_settings_dir())
    if cluster:
        # Presets say nothing about the cluster; the chart's settings are the base a preset may still refine.
        data["compute"] = _deep_merge(cluster, data.get("compute") or {})
    data = apply_overrides(data, from_trigger)
    if params.get("train_tasks") is not None and not any(o.startswith("tasks.train_candidates=") for o in extra):
        # Training tasks chosen in the form: the search candidates follow (train ∪ excluded, MASS_SPEC §1).
        tasks = data.get("tasks") or {}
        candidates = sorted(set(tasks.get("train") or []) | set(tasks.get("excluded") or []))
        data = apply_overrides(data, [f"tasks.train_candidates={json.dumps(candidates)}"])
    data = apply_environment(data, environ)
    if storage:
        data["storage"] = {**(data.get("storage") or {}), **storage}
    config = validate_config(data)
    for path in sorted({o.partition("=")[0] for o in from_trigger} & set(_MODEL_LOCATIONS)):
        location = getattr(config.models, path.rpartition(".")[2])
        problem = None if location is None else model_location_problem(location, config.storage.artifact_url)
        if problem is not None:
            raise ParamsError(f"params: {path}: {problem}")
    if config.search.iterations > MAX_SEARCH_ITERATIONS:
        raise ConfigError(
            [
                f"config: search.iterations: {config.search.iterations} exceeds the {MAX_SEARCH_ITERATIONS} "
                "version steps the cycle DAG lays out"
            ]
        )
    endpoint = backend_for(config).in_loop_endpoint(config)
    if endpoint is not None and config.inference.endpoint != endpoint:
        dumped = config.model_dump(mode="json")
        dumped["inference"]["endpoint"] = endpoint
        config = validate_config(dumped)
    return config


def _unshown_knobs(params: Mapping[str, Any]) -> dict[str, Any]:
    """`params` with every knob still at the value the form showed (its default preset's) cleared: the form can show
    one preset's values only, and a knob left as shown means "the chosen preset's value" — with another preset
    chosen, that preset's. (To force the default's value on another preset, use an override.)"""
    shown = form_preset_values(default_preset())
    return {
        key: None
        if key in KNOB_BY_PARAM and key not in DEPLOYMENT_KNOBS and shown.get(key) is not None and value == shown[key]
        else value
        for key, value in params.items()
    }


def next_cycle_params(params: Mapping[str, Any], config: CycleConfig) -> dict[str, Any]:
    """The params of the cycle after `config` (`mass_ops.ops.plan.next_cycle_overrides`: L(k+1) becomes the parent,
    models move one generation, seeds one stride); the form's own fields carry generation, parent and served name."""
    from mass_ops.ops.api import next_cycle_overrides

    try:
        following = next_cycle_overrides(config)
    except ValueError as exc:
        raise ParamsError(f"auto_continue: {exc}") from None
    own_fields = {"generation", "models.parent_bf16", "models.served_name"}
    moved = {key: value for key, value in following.items() if key not in own_fields}
    kept = [o for o in params.get("overrides") or [] if o.partition("=")[0] not in moved]
    nxt = dict(params)
    nxt.update(
        {
            "cycle_name": None,
            "allow_over_budget": False,  # an over-budget run is a decision per run, not inherited
            "generation": following["generation"],
            "served_name": following["models.served_name"],
            "parent_model": following["models.parent_bf16"],
            "overrides": [*kept, *(f"{key}={json.dumps(value)}" for key, value in moved.items())],
        }
    )
    return nxt


def as_overrides(values: Sequence[str]) -> list[str]:
    """Validate free-form override lines (KEY.PATH=VALUE) with the same pattern the form uses."""
    bad = [v for v in values if not re.match(_OVERRIDE, v)]
    if bad:
        raise ParamsError(f"params: overrides {bad} are not KEY.PATH=VALUE")
    return list(values)


if __name__ == "__main__":  # python -m mass_ops_airflow.params  (after changing the config or the knobs)
    print(write_form_schema())

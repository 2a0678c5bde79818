"""The whole config's rules: every broken rule is one `config: <field>: <rule>` line; the hash; descriptions."""

from __future__ import annotations

import copy

import pytest

from mass_ops.config import (
    ConfigError,
    config_json_schema,
    load_config,
    read_config_source,
    validate_config,
)


def _paper() -> dict:
    return read_config_source("paper")


def _set(data: dict, dotted: str, value) -> dict:
    data = copy.deepcopy(data)
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return data


def _drop(data: dict, dotted: str) -> dict:
    data = copy.deepcopy(data)
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node[part]
    del node[parts[-1]]
    return data


# (mutation, dotted field the error must name). Each is rejected with one line per problem.
MUTATIONS = [
    (lambda d: _set(d, "generation", -1), "generation"),
    (lambda d: _set(d, "generation", "zero"), "generation"),
    (lambda d: _set(d, "generation", True), "generation"),
    (lambda d: _set(d, "colour", "blue"), "colour"),
    (lambda d: _set(d, "training.learning_rate", 0.1), "training.learning_rate"),
    (lambda d: _set(d, "inference.sampling.temprature", 0.1), "inference.sampling.temprature"),
    (lambda d: _drop(d, "models"), "models"),
    (lambda d: _drop(d, "models.served_name"), "models.served_name"),
    (lambda d: _set(d, "models.served_name", ""), "models.served_name"),
    (lambda d: _set(d, "tasks.test", [60, 207, 305, 51]), "tasks"),
    (lambda d: _set(d, "tasks.excluded", [221, 60]), "tasks"),
    (lambda d: _set(d, "tasks.train", [51, 53, 56, 202, 205, 302, 307, 324, 221]), "tasks"),
    (lambda d: _set(d, "tasks.train", [51, 51, 53, 56, 202, 205, 302, 307, 324]), "tasks"),
    (lambda d: _set(d, "tasks.train_candidates", [51, 53]), "tasks"),
    (lambda d: _set(d, "tasks.train", []), "tasks"),
    (lambda d: _set(d, "tasks.test", ["sixty"]), "tasks.test.0"),
    (lambda d: _set(d, "tasks.test", [0]), "tasks.test.0"),
    (lambda d: _set(d, "inference.backend", "tgi"), "inference.backend"),
    (lambda d: _set(d, "inference.context_window_tokens", True), "inference.context_window_tokens"),
    (lambda d: _set(d, "inference.context_window_tokens", 0), "inference.context_window_tokens"),
    (lambda d: _set(d, "inference.context_window_tokens", -5), "inference.context_window_tokens"),
    (lambda d: _set(d, "inference.context_window_tokens", "262144"), "inference.context_window_tokens"),
    (lambda d: _set(d, "inference.max_output_tokens", 0), "inference.max_output_tokens"),
    (lambda d: _set(d, "inference.episode_max_output_tokens", 1.5), "inference.episode_max_output_tokens"),
    (lambda d: _set(d, "inference.context_safety_tokens", None), "inference.context_safety_tokens"),
    (lambda d: _set(d, "inference.max_output_tokens", 122880 * 2 + 20000), "inference"),
    (lambda d: _set(d, "inference.context_window_tokens", 57344), "inference"),
    (lambda d: _set(d, "inference.endpoint", "ftp://127.0.0.1:8001/v1"), "inference"),
    (lambda d: _set(d, "inference.endpoint", "http://user:pw@127.0.0.1:8001/v1"), "inference"),
    (lambda d: _set(d, "inference.endpoint", "http://127.0.0.1:8001/v1?x=1"), "inference"),
    (lambda d: _set(d, "inference.endpoint", "http://127.0.0.1/v1"), "inference"),
    (lambda d: _set(d, "inference.endpoint", "not a url"), "inference"),
    (lambda d: _set(_set(d, "inference.backend", "openrouter"), "inference.endpoint", "https://x.ai/v1"), "inference"),
    (lambda d: _set(d, "inference.reasoning_effort", "xhigh"), "inference.reasoning_effort"),
    (lambda d: _set(d, "inference.server.scheduling_policy", "lifo"), "inference.server.scheduling_policy"),
    (
        lambda d: _set(
            _set(d, "inference.backend", "openai-compatible"), "inference.server.scheduling_policy", "priority"
        ),
        "inference",
    ),
    (lambda d: _set(d, "inference.api_key_env", "sk-secret value"), "inference"),
    (lambda d: _set(d, "inference.sampling.temperature", 3.0), "inference.sampling.temperature"),
    (lambda d: _set(d, "inference.sampling.top_p", 0), "inference.sampling.top_p"),
    (lambda d: _set(d, "inference.sampling.enable_thinking", "yes"), "inference.sampling.enable_thinking"),
    (lambda d: _set(d, "search.iterations", 0), "search.iterations"),
    (lambda d: _set(d, "search.seed_base", -1), "search.seed_base"),
    (lambda d: _set(d, "collection.validation_rank", 17), "collection"),
    (lambda d: _set(d, "collection.candidates", 15), "collection"),
    (lambda d: _set(d, "collection.train_ranks", 0), "collection.train_ranks"),
    (lambda d: _set(d, "ranking.opponents_per_episode", 5), "ranking"),
    (lambda d: _set(d, "ranking.seed", "1234"), "ranking.seed"),
    (lambda d: _set(d, "training.grad_accum", 2), "training"),
    (lambda d: _set(d, "training.replicas", 2), "training"),
    (lambda d: _set(d, "training.context_overlap", 49152), "training"),
    (lambda d: _set(d, "training.window", 0), "training.window"),
    (lambda d: _set(d, "training.lr", 0), "training.lr"),
    (lambda d: _set(d, "training.lr", "3e-5"), "training.lr"),
    (lambda d: _set(d, "training.lora_r", 0), "training.lora_r"),
    (lambda d: _set(d, "training.lora_dropout", 1.0), "training.lora_dropout"),
    (lambda d: _set(d, "training.lora_target_modules", []), "training"),
    (lambda d: _set(d, "training.lora_target_modules", ["q_proj", "1bad.name"]), "training"),
    (lambda d: _set(d, "training.p_orch", 1.5), "training.p_orch"),
    (lambda d: _set(d, "training.warmup_steps", 1624), "training"),
    (lambda d: _set(d, "training.sampler", "condition"), "training.sampler"),
    (lambda d: _set(d, "training.zero_stage", 2), "training.zero_stage"),
    (lambda d: _set(d, "training.windows_per_step", None), "training.windows_per_step"),
    (lambda d: _set(d, "storage.metadata_url", "mysql://localhost/db"), "storage"),
    (lambda d: _set(d, "storage.artifact_url", "gs://bucket/prefix"), "storage"),
    (lambda d: _set(d, "storage.artifact_url", "s3://B_/prefix"), "storage"),
    (lambda d: _set(d, "compute.backend", "slurm"), "compute.backend"),
    (lambda d: _set(d, "compute.kubernetes.namespace", "Bad_Namespace"), "compute.kubernetes"),
    (lambda d: _set(d, "evaluation.tasks", [51, 999]), "evaluation.tasks"),
    (lambda d: _set(d, "evaluation.judges", [{"name": "x", "provider": "anthropic", "model": "m"}]), "evaluation"),
    (lambda d: _set(d, "evaluation.regression_threshold", 2), "evaluation.regression_threshold"),
    (lambda d: _set(d, "runtime.episode_wall_clock_s", 0), "runtime.episode_wall_clock_s"),
    (lambda d: _set(d, "name", "bad name with spaces"), "name"),
]


def test_there_are_at_least_fifty_mutations():
    assert len(MUTATIONS) >= 50


@pytest.mark.parametrize(("mutate", "field"), MUTATIONS, ids=[f"m{i:02d}" for i in range(len(MUTATIONS))])
def test_mutated_config_is_rejected_with_one_line_naming_the_field(mutate, field):
    with pytest.raises(ConfigError) as info:
        validate_config(mutate(_paper()))
    problems = info.value.problems
    assert problems, "a rejected config must say why"
    assert all("\n" not in line and line.startswith("config: ") for line in problems)
    assert any(line.startswith(f"config: {field}") for line in problems), problems


def test_every_problem_is_reported_not_just_the_first():
    data = _set(_set(_paper(), "search.iterations", 0), "ranking.seed", -3)
    with pytest.raises(ConfigError) as info:
        validate_config(data)
    fields = {line.split(":")[1].strip() for line in info.value.problems}
    assert {"search.iterations", "ranking.seed"} <= fields


def test_hash_changes_with_any_knob():
    base = load_config("paper", environ={}).config_hash()
    assert load_config("paper", ["training.steps=1600"], environ={}).config_hash() != base
    assert load_config("paper", environ={}).config_hash() == base


# --- Every field is described (#14): the Airflow trigger form shows these texts -------------------------------------


def _schema_properties(schema: dict) -> dict[str, dict]:
    """Every property of the config's JSON Schema, as '<Model>.<field>' -> its schema (nested models included)."""
    found = {f"CycleConfig.{name}": prop for name, prop in schema["properties"].items()}
    for model, definition in schema.get("$defs", {}).items():
        for name, prop in definition.get("properties", {}).items():
            found[f"{model}.{name}"] = prop
    return found


def test_every_config_field_has_a_description():
    properties = _schema_properties(config_json_schema())
    assert len(properties) > 117
    undescribed = sorted(name for name, prop in properties.items() if not str(prop.get("description", "")).strip())
    assert undescribed == [], f"fields without a description: {undescribed}"

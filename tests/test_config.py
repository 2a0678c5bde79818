"""The cycle config: paper constants, validation rules (one line per problem), overrides, environment, schema."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mass_ops.config import (
    PRESET_NAMES,
    ConfigError,
    CycleConfig,
    apply_overrides,
    config_json_schema,
    load_config,
    preset_path,
    read_config_source,
    validate_config,
)

# MASS_SPEC §2, configs/paper.json, written out independently of the preset file.
PAPER = {
    "generation": 0,
    "models.served_name": "Qwen/Qwen3.6-27B-FP8",
    "models.parent_bf16": "models/L0-bf16",
    "models.fp8_reference": "models/L0-fp8",
    "models.next_bf16": "models/L1-bf16",
    "models.next_fp8": "models/L1-fp8",
    "inference.endpoint": "http://127.0.0.1:8001/v1",
    "inference.backend": "vllm",
    "inference.context_window_tokens": 262144,
    "inference.episode_max_output_tokens": 32768,
    "inference.max_output_tokens": 49152,
    "inference.context_safety_tokens": 8192,
    "inference.reasoning_effort": "medium",
    "inference.sampling.temperature": 0.6,
    "inference.sampling.top_p": 0.95,
    "inference.sampling.top_k": 20,
    "inference.sampling.enable_thinking": True,
    "inference.server.max_num_seqs": 4,
    "inference.server.gpu_memory_utilization": 0.9,
    "inference.server.tool_call_parser": "qwen3_coder",
    "inference.server.reasoning_parser": "qwen3",
    "tasks.train_candidates": [51, 53, 56, 202, 205, 221, 302, 307, 324],
    "tasks.train": [51, 53, 56, 202, 205, 302, 307, 324],
    "tasks.test": [60, 207, 305],
    "tasks.excluded": [221],
    "search.iterations": 11,
    "search.seed_base": 450000,
    "collection.candidates": 18,
    "collection.train_ranks": 15,
    "collection.validation_rank": 16,
    "collection.seed_base": 710000,
    "ranking.opponents_per_episode": 6,
    "ranking.seed": 1234,
    "training.window": 49152,
    "training.context_overlap": 8192,
    "training.steps": 1624,
    "training.lr": 3e-05,
    "training.warmup_steps": 5,
    "training.min_lr_ratio": 0.1,
    "training.lora_r": 64,
    "training.lora_alpha": 128,
    "training.lora_dropout": 0.05,
    "training.save_every": 50,
    "training.val_every": 150,
    "training.replicas": 3,
    "training.gpus_per_rank": 2,
    "training.grad_accum": 1,
    "training.ce_chunk": 512,
    "training.seed": 1234,
    "training.sampler": "task_role",
    "training.p_orch": 1 / 3,
    "evaluation.rollout_count": 10,
    "evaluation.rollout_seed_base": 910000,
    "evaluation.judge_seeds": [42, 43, 44],
    # The reference's verdict schema exactly (MASS_SPEC §5), and its gpt-5.5 judge on the Responses API, uncapped.
    "judge.verdict_parsing": "strict",
}
CYCLE2_CHANGES = {
    "generation": 1,
    "models.served_name": "L1",
    "models.parent_bf16": "models/L1-bf16",
    "models.fp8_reference": "models/L0-fp8",
    "models.next_bf16": "models/L2-bf16",
    "models.next_fp8": "models/L2-fp8",
    "search.seed_base": 1450000,
    "collection.seed_base": 1710000,
}


def test_the_paper_gpt_judge_is_the_references_responses_call():
    for preset in ("paper", "cycle2"):
        gpt = next(j for j in load_config(preset, environ={}).evaluation.judges if j.model == "gpt-5.5")
        assert (gpt.api, gpt.reasoning_effort, gpt.max_tokens) == ("responses", "xhigh", None)


def _get(config: CycleConfig, dotted: str):
    node = config
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


@pytest.mark.parametrize("key", sorted(PAPER))
def test_paper_preset_reproduces_reference_constant(key):
    assert _get(load_config("paper", environ={}), key) == PAPER[key]


@pytest.mark.parametrize("key", sorted(PAPER))
def test_cycle2_preset_is_paper_with_the_cycle2_changes(key):
    expected = CYCLE2_CHANGES.get(key, PAPER[key])
    assert _get(load_config("cycle2", environ={}), key) == expected


def test_paper_presets_average_three_windows_per_step():
    for name in ("paper", "cycle2"):
        assert load_config(name, environ={}).training.effective_windows_per_step == 3


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_validates_and_names_its_cycle(name):
    config = load_config(name, environ={})
    assert config.preset == name
    assert config.cycle_name == f"{name}-L{config.generation}"


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


def test_overrides_parse_yaml_values_and_reach_nested_keys():
    config = load_config(
        "paper", ["search.iterations=3", "tasks.test=[60]", "evaluation.tasks=null", "training.lr=0.001"], environ={}
    )
    assert config.search.iterations == 3
    assert config.tasks.test == [60]
    assert config.training.lr == pytest.approx(0.001)


def test_malformed_override_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"expected KEY\.PATH=VALUE"):
        apply_overrides({}, ["no_equals_sign"])
    with pytest.raises(ConfigError, match="is not a section"):
        apply_overrides({"generation": 0}, ["generation.x=1"])


def test_environment_overrides_storage_of_any_config():
    env = {"MASS_METADATA_URL": "postgresql://postgres@127.0.0.1:5432/test", "MASS_ARTIFACT_URL": "s3://bucket/pre"}
    config = load_config("demo", environ=env)
    assert config.storage.metadata_url == env["MASS_METADATA_URL"]
    assert config.storage.artifact_url == "s3://bucket/pre"
    # Storage is where the cycle lives, not what it is: the frozen hash ignores it.
    assert config.config_hash() == load_config("demo", environ={}).config_hash()


def test_hash_changes_with_any_knob():
    base = load_config("paper", environ={}).config_hash()
    assert load_config("paper", ["training.steps=1600"], environ={}).config_hash() != base
    assert load_config("paper", environ={}).config_hash() == base


def test_json_and_yaml_files_load(tmp_path):
    data = _paper()
    (tmp_path / "c.json").write_text(json.dumps(data))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    assert load_config(tmp_path / "c.json", environ={}) == load_config(tmp_path / "c.yaml", environ={})


def test_unreadable_sources_are_one_line_errors(tmp_path):
    (tmp_path / "broken.yaml").write_text("a: [unclosed\n")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    for source, needle in (
        (tmp_path / "missing.yaml", "no such preset or file"),
        (tmp_path / "broken.yaml", "not valid yaml"),
        (tmp_path / "list.yaml", "top level must be a mapping"),
    ):
        with pytest.raises(ConfigError) as info:
            load_config(source, environ={})
        assert len(info.value.problems) == 1 and needle in info.value.problems[0]


def test_json_schema_exports_every_section():
    schema = config_json_schema()
    assert schema["type"] == "object"
    for section in ("models", "inference", "tasks", "search", "collection", "ranking", "training", "storage"):
        assert section in schema["properties"]
    json.dumps(schema)  # must be plain JSON


def test_preset_files_ship_in_the_package():
    for name in PRESET_NAMES:
        assert preset_path(name).is_file()


def test_rollout_pool_defaults_to_sft_plus_test_tasks():
    config = load_config("paper", ["evaluation.tasks=null"], environ={})
    assert config.rollout_tasks() == [51, 53, 56, 202, 205, 302, 307, 324, 60, 207, 305]
    assert config.tasks.for_split("all") == [51, 53, 56, 202, 205, 221, 302, 307, 324, 60, 207, 305]


# --- The task catalogue of the paper presets is the user's explicit choice (#12.4) -------------------------------


@pytest.mark.parametrize("name", ["paper", "cycle2"])
def test_paper_presets_leave_the_catalogue_unchosen(name):
    config = load_config(name, environ={})
    assert config.tasks.catalogue is None
    assert config.catalogue_label == "not chosen"
    with pytest.raises(ConfigError) as info:
        config.require_catalogue()
    (line,) = info.value.problems
    assert str(info.value) == line
    assert line.startswith("config: tasks.catalogue: not chosen")
    assert "mass-ops tasks import <reference>/tasks --dest DIR" in line
    assert "--set tasks.catalogue=DIR" in line
    assert "--set tasks.catalogue=builtin" in line


@pytest.mark.parametrize("choice", ["builtin", "catalogues/reference"])
def test_an_explicit_catalogue_is_what_require_catalogue_returns(choice):
    config = load_config("paper", [f"tasks.catalogue={choice}"], environ={})
    assert config.require_catalogue() == choice == config.catalogue_label


def test_demo_and_custom_configs_keep_the_builtin_catalogue():
    assert load_config("demo", environ={}).require_catalogue() == "builtin"
    data = read_config_source("demo")
    del data["tasks"]["catalogue"]
    assert validate_config(data).require_catalogue() == "builtin"


def test_an_empty_catalogue_is_refused():
    with pytest.raises(ConfigError, match=r"tasks\.catalogue: String should have at least 1 character"):
        load_config("paper", ["tasks.catalogue="], environ={})


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_plan_works_offline_on_every_preset(name, tmp_path):
    done = subprocess.run(
        [str(Path(sys.executable).with_name("mass-ops")), "plan", "--config", name, "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "MASS_METADATA_URL": "", "MASS_ARTIFACT_URL": ""},
    )
    assert done.returncode == 0, done.stderr
    catalogue = json.loads(done.stdout)["config"]["tasks"]["catalogue"]
    assert catalogue == (None if name in ("paper", "cycle2") else "builtin")
    assert list(tmp_path.iterdir()) == []


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

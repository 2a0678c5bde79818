"""Trigger-form params come from the config's JSON Schema; the config is rebuilt from them with every rule."""

from __future__ import annotations

import json

import pytest
from airflow.sdk import Param
from airflow.sdk.definitions.param import ParamsDict
from mass_ops_airflow import params as form
from mass_ops_airflow.params import (
    FORM_SCHEMA_FILE,
    KNOBS,
    MAX_SEARCH_ITERATIONS,
    ParamsError,
    build_config,
    cycle_params,
    generate_form_schema,
    next_cycle_params,
)

from mass_ops.compute.kubernetes import inference_url
from mass_ops.config import ConfigError, load_config


def test_shipped_form_schema_matches_the_config():
    shipped = json.loads(FORM_SCHEMA_FILE.read_text())
    assert shipped == json.loads(json.dumps(generate_form_schema())), (
        "the config or the knobs changed: run `python -m mass_ops_airflow.params` to regenerate form_schema.json"
    )


def test_every_knob_is_a_nullable_config_field():
    schema = generate_form_schema()["knobs"]
    assert set(schema) == {k.param for k in KNOBS}
    for knob in KNOBS:
        spec = schema[knob.param]
        accepts_null = "null" in (spec.get("type") or []) or {"type": "null"} in spec.get("anyOf", [])
        assert accepts_null, knob
        assert knob.path in spec["description"] and spec["section"]


def test_search_iterations_bound_covers_every_preset():
    for preset in generate_form_schema()["presets"]:
        assert load_config(preset).search.iterations <= MAX_SEARCH_ITERATIONS, preset


def resolve(name: str, value):
    return cycle_params()[name].resolve(value)


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("search_iterations", 0),
        ("search_iterations", "three"),
        ("compute_backend", "gpu-farm"),
        ("learning_rate", 1.5),
        ("train_tasks", [51, -2]),
        ("regression_threshold", 2),
        ("overrides", ["not an override"]),
        ("auto_continue", "yes"),
    ],
)
def test_the_form_rejects_values_the_config_would_refuse(name, bad):
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError):
        resolve(name, bad)


def test_the_form_accepts_empty_knobs_and_good_values():
    assert resolve("search_iterations", None) is None
    assert resolve("search_iterations", 3) == 3
    assert resolve("compute_backend", "kubernetes") == "kubernetes"
    assert resolve("learning_rate", 0.0001) == 0.0001
    defaults = ParamsDict(cycle_params(preset="demo"))
    defaults.validate()
    assert defaults["preset"] == "demo" and defaults["overrides"] == [] and defaults["auto_continue"] is False


def test_nightly_params_are_a_subset():
    nightly = cycle_params(knobs=form.NIGHTLY_KNOBS)
    assert set(nightly) == {"preset", "overrides", *form.NIGHTLY_KNOBS}
    with pytest.raises(ParamsError, match="unknown knobs"):
        cycle_params(knobs=["warp_speed"])
    assert all(isinstance(p, Param) for p in nightly.values())


def test_the_nightly_slice_params_are_run_params_not_config(tmp_path):
    slice_params = form.nightly_slice_params()
    assert tuple(slice_params) == form.NIGHTLY_RUN_PARAMS
    checked = ParamsDict({**cycle_params(knobs=form.NIGHTLY_KNOBS), **slice_params})
    checked.validate()
    assert checked["benchmark_slice"] == [] and checked["benchmark_slice_instances"] == form.NIGHTLY_SLICE_INSTANCES
    chosen = {"preset": "demo", "benchmark_slice": ["ds"], "benchmark_slice_instances": 2, "benchmark_data_dir": "/d"}
    # The nightly's server and report operators build the config from the whole params: accepted and ignored there.
    plain = build_config({"preset": "demo"}, settings_dir=tmp_path, environ={})
    assert build_config(chosen, settings_dir=tmp_path, environ={}) == plain
    assert form.config_params(chosen, form.NIGHTLY_RUN_PARAMS) == {"preset": "demo"}
    with pytest.raises(ParamsError, match=r"unknown \['benchmark_slices'\]"):  # a typo is still refused
        build_config({"preset": "demo", "benchmark_slices": ["ds"]}, settings_dir=tmp_path, environ={})


def test_preset_alone_is_the_preset(tmp_path):
    assert build_config({"preset": "paper"}, settings_dir=tmp_path, environ={}) == load_config("paper", environ={})


def test_knobs_and_overrides_apply_in_order(tmp_path):
    config = build_config(
        {
            "preset": "demo",
            "generation": 3,
            "search_iterations": 2,
            "learning_rate": 0.0005,
            "overrides": ["ranking.seed=7", "search.iterations=4"],
        },
        settings_dir=tmp_path,
        environ={},
    )
    assert (config.generation, config.training.lr, config.ranking.seed) == (3, 0.0005, 7)
    assert config.search.iterations == 4, "free overrides come after the knobs"


def test_training_tasks_carry_the_candidates_along(tmp_path):
    params = {"preset": "paper", "train_tasks": [51, 53], "overrides": ["evaluation.tasks=null"]}
    config = build_config(params, settings_dir=tmp_path, environ={})
    assert config.tasks.train == [51, 53]
    assert config.tasks.train_candidates == [51, 53, 221], "train ∪ excluded (221 stays searched, not trained)"


def test_bad_values_fail_with_one_line_per_problem(tmp_path):
    with pytest.raises(ConfigError) as caught:
        build_config(
            {"preset": "demo", "candidates": 1, "overrides": ["training.warmup_steps=99"]},
            settings_dir=tmp_path,
            environ={},
        )
    assert any(line.startswith("config: collection.candidates:") for line in caught.value.problems)
    assert any(line.startswith("config: training.warmup_steps:") for line in caught.value.problems)
    with pytest.raises(ConfigError, match=f"exceeds the {MAX_SEARCH_ITERATIONS} version steps"):
        build_config({"preset": "demo", "overrides": ["search.iterations=12"]}, settings_dir=tmp_path, environ={})
    with pytest.raises(ParamsError, match="unknown"):
        build_config({"preset": "demo", "seed": 1}, settings_dir=tmp_path, environ={})
    with pytest.raises(ParamsError, match=r"not KEY\.PATH=VALUE"):
        build_config({"preset": "demo", "overrides": ["= 3"]}, settings_dir=tmp_path, environ={})


def test_cluster_settings_are_the_base_and_move_the_endpoint(tmp_path):
    (tmp_path / "kubernetes.yaml").write_text(
        "compute:\n  backend: kubernetes\n  kubernetes:\n    namespace: research\n    episode_cpu: '2'\n"
    )
    config = build_config({"preset": "paper"}, settings_dir=tmp_path, environ={})
    assert config.compute.backend == "kubernetes" and config.compute.kubernetes.namespace == "research"
    assert config.inference.endpoint == inference_url(config, config.cycle_name, config.models.served_name)
    assert config.inference.endpoint.startswith("http://vllm-paper-l0-qwen-qwen3-6-27b-fp8")
    local = build_config({"preset": "paper", "compute_backend": "local"}, settings_dir=tmp_path, environ={})
    assert local.inference.endpoint == "http://127.0.0.1:8001/v1"


def test_storage_precedence_connections_over_environment(tmp_path):
    env = {"MASS_METADATA_URL": "sqlite:///from-env.db", "MASS_ARTIFACT_URL": "s3://env-bucket/x"}
    config = build_config(
        {"preset": "demo"},
        storage={"metadata_url": "postgresql://u:p@db/mass"},
        settings_dir=tmp_path,
        environ=env,
    )
    assert config.storage.metadata_url == "postgresql://u:p@db/mass"
    assert config.storage.artifact_url == "s3://env-bucket/x"


def test_next_cycle_of_paper_is_cycle2(tmp_path):
    params = {"preset": "paper", "overrides": ["ranking.seed=1234"]}
    paper = build_config(params, settings_dir=tmp_path, environ={})
    nxt = build_config(next_cycle_params(params, paper), settings_dir=tmp_path, environ={})
    cycle2 = load_config("cycle2", environ={})
    assert nxt.model_dump(exclude={"preset", "name"}) == cycle2.model_dump(exclude={"preset", "name"})
    assert nxt.cycle_name == "paper-L1" != paper.cycle_name
    again = next_cycle_params(next_cycle_params(params, paper), nxt)
    assert [o for o in again["overrides"] if o.startswith("search.seed_base")] == ["search.seed_base=2450000"]


def test_next_cycle_needs_generation_named_model_keys(tmp_path):
    config = build_config(
        {"preset": "demo", "overrides": ["models.next_bf16=models/custom-bf16"]}, settings_dir=tmp_path, environ={}
    )
    with pytest.raises(ParamsError, match="cannot derive the next cycle's model key"):
        next_cycle_params({"preset": "demo"}, config)

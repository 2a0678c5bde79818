"""Trigger-form params come from the config's JSON Schema; the config is rebuilt from them with every rule."""

from __future__ import annotations

import json
import re

import pytest
from airflow.sdk import Param
from airflow.sdk.definitions.param import ParamsDict
from mass_ops_airflow import params as form
from mass_ops_airflow.params import (
    FORM_SCHEMA_FILE,
    KNOB_BY_PARAM,
    KNOBS,
    MAX_SEARCH_ITERATIONS,
    ParamsError,
    build_config,
    cycle_params,
    form_preset_values,
    generate_form_schema,
    knob_param_spec,
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
        assert spec["description"] and spec["section"]
        assert knob.path in cycle_params()[knob.param].description


def test_the_form_shows_the_default_preset_s_values_in_words_people_use(monkeypatch):
    monkeypatch.setenv("MASS_DEFAULT_PRESET", "paper")
    form_preset_values.cache_clear()
    params = cycle_params()
    paper = load_config("paper")
    assert params["lora_r"].value == paper.training.lora_r and params["gpus_per_node"].value == 8
    assert params["train_tasks"].value == paper.tasks.train and params["compute_backend"].value is None
    assert "The paper preset sets local;" in params["compute_backend"].description
    assert params["lora_r"].schema["title"] == "LoRA rank"
    assert params["gpus_per_node"].schema["title"] == "GPUs per node"
    assert "The paper preset sets 64;" in params["lora_r"].description
    for name in ("training_steps", "lora_r", "learning_rate", "test_tasks", "candidates", "regression_threshold"):
        assert not re.search(r"\b[Rr]eference\b|Default \d", params[name].description), name
    # the UI labels a dropdown's choices by values_display: its empty choice reads in words, never `null`
    display = params["compute_backend"].schema["values_display"]
    assert display["null"] == "the preset's value" and "null" not in display.values()
    # Airflow's form marks a field required when its type excludes null: only what must be given is
    required = [n for n, p in params.items() if "null" not in (p.schema.get("type") or ["null"])]
    assert required == [], required
    link = params["allow_over_budget"].schema["description_md"]
    assert "](/mass-ops/estimate?preset=paper)" in link
    assert params["allow_over_budget"].description is None  # else the form shows it, not the Markdown link

    monkeypatch.setenv("MASS_DEFAULT_PRESET", "demo")
    demo = cycle_params()
    assert demo["lora_r"].value == 8 and demo["training_steps"].value == 4
    assert "The demo preset sets 60;" in demo["test_tasks"].description


def test_an_empty_preset_list_shows_an_empty_field_and_knobs_left_as_shown_follow_the_chosen_preset(
    monkeypatch, tmp_path
):
    spec = {"type": ["array", "null"], "description": "Held-out task ids"}
    default, _ = knob_param_spec(KNOB_BY_PARAM["test_tasks"], spec, "demo", [])
    assert default is None
    monkeypatch.setenv("MASS_DEFAULT_PRESET", "demo")
    form = {name: p.value for name, p in cycle_params().items()}
    # triggered with another preset but the knobs as the form showed them: the paper preset's own values run
    config = build_config({**form, "preset": "paper"}, settings_dir=tmp_path, environ={})
    assert config.training.lora_r == 64 and config.tasks.train == load_config("paper").tasks.train
    changed = build_config({**form, "preset": "paper", "lora_r": 16}, settings_dir=tmp_path, environ={})
    assert changed.training.lora_r == 16 and changed.training.steps == load_config("paper").training.steps
    # with the default preset itself, the form's values are the preset's config, train candidates included
    same = build_config(form, settings_dir=tmp_path, environ={})
    assert same.tasks.train_candidates == load_config("demo").tasks.train_candidates


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


# -- a trigger sets experiment settings only; what runs next to the secrets is the deployment's ---------------------


def config_leaf_paths() -> list[str]:
    """Every leaf field of the config as a dotted path (sections expanded, maps and lists of models kept whole)."""
    from mass_ops.config import config_json_schema

    root = config_json_schema()
    paths: list[str] = []
    stack: list[tuple[str, dict]] = [("", root)]
    while stack:
        prefix, node = stack.pop()
        for name in node.get("properties") or {}:
            path = f"{prefix}{name}"
            field = form.field_schema(path, root)
            if field.get("type") == "object" and "properties" in field:
                stack.append((f"{path}.", field))
            else:
                paths.append(path)
    return sorted(paths)


def settable(path: str) -> bool:
    return any(path == a or path.startswith(f"{a}.") for a in form.TRIGGER_SETTABLE)


# The attack surface named in the issue: each of these is what a trigger must never choose.
MUST_BE_DEPLOYMENT = (
    "compute.kubernetes.image_episode",
    "compute.kubernetes.image_trainer",
    "compute.kubernetes.image_inference",
    "compute.kubernetes.namespace",
    "compute.kubernetes.node_selector",
    "compute.kubernetes.gpu_tolerations",
    "compute.kubernetes.model_cache_pvc",
    "compute.local_inference",
    "inference.backend",
    "inference.endpoint",
    "inference.api_key_env",
    "inference.server.port",
    "evaluation.judges",
    "prompts.dir",
    "storage.metadata_url",
    "storage.artifact_url",
    "runtime.episode_cuda_visible_devices",
)


def test_the_allowlist_names_real_config_fields_and_leaves_the_deployment_s_own_out():
    leaves = config_leaf_paths()
    for allowed in form.TRIGGER_SETTABLE:  # a typo here would silently allow nothing
        assert any(leaf == allowed or leaf.startswith(f"{allowed}.") for leaf in leaves), allowed
    assert set(MUST_BE_DEPLOYMENT) <= set(leaves)
    assert not [path for path in MUST_BE_DEPLOYMENT if settable(path)]
    sandbox = [leaf for leaf in leaves if "sandbox" in leaf]  # runtime.sandbox, runtime.allow_unsandboxed_agent
    assert not [path for path in sandbox if settable(path)], "sandbox settings are the deployment's"


@pytest.mark.parametrize("path", [p for p in config_leaf_paths() if not settable(p)])
def test_every_deployment_only_path_is_refused_in_one_line(tmp_path, path):
    with pytest.raises(ParamsError) as caught:
        build_config({"preset": "demo", "overrides": [f"{path}=evil"]}, settings_dir=tmp_path, environ={})
    assert str(caught.value) == (
        f"params: {path} is set by the deployment, not by a trigger (a trigger sets experiment settings "
        "only: mass_ops_airflow.params.TRIGGER_SETTABLE)"
    )


@pytest.mark.parametrize(
    "override",
    [
        "compute.kubernetes.image_episode=registry.evil/episode:latest",
        # A whole section at once carries a deployment key inside it.
        'compute={"backend": "kubernetes", "kubernetes": {"image_episode": "registry.evil/x"}}',
        'inference={"endpoint": "http://evil:8000/v1"}',
        'evaluation={"judges": [{"name": "j", "provider": "anthropic", "model": "m", "api_key_env": "AWS_SECRET"}]}',
        'models={"next_bf16": "/home/airflow/.ssh/authorized_keys"}',
        "storage.artifact_url=s3://attacker-bucket/loot",
        "tasks.catalogue=/etc",
        "models.next_bf16=/home/airflow/.ssh",
        "models.parent_bf16=s3://other-bucket/model",
        "models.next_fp8=models/../../escape",
    ],
)
def test_a_trigger_cannot_choose_images_endpoints_judges_storage_or_server_paths(tmp_path, override):
    from mass_ops_airflow.cycle import cycle_config

    with pytest.raises(ParamsError) as caught:
        cycle_config({"preset": "demo", "overrides": [override]})
    assert "\n" not in str(caught.value) and str(caught.value).startswith("params: ")


KNOB_VALUES = {
    "cycle_name": "trial-7",
    "generation": 2,
    "served_name": "mass-tiny-L2",
    "parent_model": "models/L2-bf16",
    "compute_backend": "local",
    "max_concurrent_requests": 3,
    "train_tasks": [51],
    "test_tasks": [60],
    "search_iterations": 2,
    "candidates": 3,
    "training_steps": 5,
    "learning_rate": 0.0002,
    "lora_r": 8,
    "training_nnodes": 1,
    "gpus_per_node": 2,
    "rollout_count": 2,
    "regression_threshold": 0.1,
}


def test_every_knob_of_the_form_still_works(tmp_path):
    assert set(KNOB_VALUES) == set(form.KNOB_BY_PARAM), "give each new knob a value here"
    assert all(settable(knob.path) for knob in KNOBS)
    config = build_config(
        {"preset": "demo", **KNOB_VALUES, "overrides": ["tasks.catalogue=builtin", "budgets.cycle_tokens=9"]},
        settings_dir=tmp_path,
        environ={},
    )
    dumped = config.model_dump(mode="json")
    for param, value in KNOB_VALUES.items():
        node = dumped
        for part in form.KNOB_BY_PARAM[param].path.split("."):
            node = node[part]
        assert node == value, param


@pytest.mark.parametrize("preset", ["/etc/passwd", "../../etc/mass-ops/settings/kubernetes", "demo.yaml", "demo/"])
def test_a_trigger_names_a_preset_never_a_file(tmp_path, monkeypatch, preset):
    monkeypatch.setenv("MASS_PRESETS_DIR", str(tmp_path))
    with pytest.raises(ParamsError, match=r"^params: preset .* is not a preset name .*a trigger cannot name a file$"):
        build_config({"preset": preset}, settings_dir=tmp_path, environ={})


def test_a_file_the_caller_wrote_is_not_a_preset_but_a_deployment_registered_one_is(tmp_path, monkeypatch):
    # The attacker's file would set the image; naming it as the preset must not load it.
    evil = tmp_path / "evil.yaml"
    evil.write_text(preset_text_with_image("registry.evil/episode:1"), encoding="utf-8")
    registered = tmp_path / "registered"
    registered.mkdir()
    (registered / "lab.yaml").write_text(preset_text_with_image("registry.lab/episode:2"), encoding="utf-8")
    monkeypatch.setenv("MASS_PRESETS_DIR", str(registered))
    monkeypatch.delenv("MASS_DEFAULT_PRESET", raising=False)
    with pytest.raises(ParamsError, match="is not a preset name"):
        build_config({"preset": str(evil)}, settings_dir=tmp_path, environ={})
    lab = build_config({"preset": "lab"}, settings_dir=tmp_path, environ={})
    assert lab.compute.kubernetes.image_episode == "registry.lab/episode:2"
    # The deployment's own default (the demo's UI points it at a file it wrote) stays usable by its value.
    monkeypatch.setenv("MASS_DEFAULT_PRESET", str(evil))
    assert build_config({"preset": str(evil)}, settings_dir=tmp_path, environ={}).compute.kubernetes.image_episode
    assert build_config({}, settings_dir=tmp_path, environ={}).compute.kubernetes.image_episode == (
        "registry.evil/episode:1"
    )


def preset_text_with_image(image: str) -> str:
    """The demo preset's text with the episode image set (a config a deployment, or an attacker, could write)."""
    import yaml

    from mass_ops.config import preset_path

    data = yaml.safe_load(preset_path("demo").read_text(encoding="utf-8"))
    data.setdefault("compute", {}).setdefault("kubernetes", {})["image_episode"] = image
    return yaml.safe_dump(data)


def test_model_locations_stay_inside_the_deployment_s_artifact_store(tmp_path):
    storage = {"artifact_url": "s3://deploy-bucket/mass"}

    def build(*overrides: str):
        params = {"preset": "demo", "overrides": list(overrides)}
        return build_config(params, storage=storage, settings_dir=tmp_path, environ={})

    inside = build("models.next_bf16=s3://deploy-bucket/mass/models/L1-bf16", "models.parent_bf16=models/L0-bf16")
    assert inside.models.next_bf16 == "s3://deploy-bucket/mass/models/L1-bf16"
    for outside in ("s3://deploy-bucket/massive/x", "s3://other-bucket/mass/models/L1", "/var/lib/airflow/x"):
        with pytest.raises(ParamsError, match=r"^params: models\.next_fp8: must be a key in the deployment's"):
            build(f"models.next_fp8={outside}")
    with pytest.raises(ParamsError, match=r"^params: models\.parent_bf16: "):
        build_config(
            {"preset": "demo", "parent_model": "/root/.cache/model"}, storage=storage, settings_dir=tmp_path, environ={}
        )

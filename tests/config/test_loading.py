"""From a preset or file to a config: overrides, the environment, file formats, unreadable sources, schema."""

from __future__ import annotations

import json

import pytest
import yaml

from mass_ops.config import (
    ConfigError,
    apply_overrides,
    config_json_schema,
    load_config,
    read_config_source,
)


def _paper() -> dict:
    return read_config_source("paper")


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

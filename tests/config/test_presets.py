"""The shipped presets: the reference's constants (MASS_SPEC §2), cycle 2's changes, the catalogue choice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mass_ops.config import (
    PRESET_NAMES,
    ConfigError,
    CycleConfig,
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

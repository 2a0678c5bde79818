"""The `training:` section: the trainer settings it shares with a training job, its layout fields and its rules."""

from __future__ import annotations

import pytest

from mass_ops.config import (
    ConfigError,
    TrainerSettings,
    TrainingConfig,
    load_config,
    read_config_source,
    validate_config,
)


def _paper_with(**training: object) -> dict:
    data = read_config_source("paper")
    data["training"].update(training)
    return data


def test_the_section_is_the_trainer_settings_plus_windows_and_topology():
    layout = set(TrainingConfig.model_fields) - set(TrainerSettings.model_fields)
    assert layout == {
        "window",
        "context_overlap",
        "max_header_frac",
        "replicas",
        "gpus_per_rank",
        "windows_per_step",
        "nnodes",
        "gpus_per_node",
    }


def test_broken_training_rules_are_reported_together_in_a_fixed_order():
    data = _paper_with(
        context_overlap=60000,
        warmup_steps=2000,
        replicas=4,
        lora_target_modules=["q_proj", "a.b"],
        val_every=5000,
        deepspeed_overrides={"optimizer": {}, "zero_optimization": {"reduce_bucket_size": 5}},
    )
    with pytest.raises(ConfigError) as info:
        validate_config(data)
    assert info.value.problems == [
        "config: training.context_overlap: 60000 must be below window (49152)",
        "config: training.warmup_steps: 2000 must be below steps (1624)",
        "config: training.windows_per_step: replicas × grad_accum = 4 must equal windows_per_step (3)",
        "config: training.lora_target_modules: ['a.b'] are not module names",
        "config: training.val_every: 5000 must not exceed steps (1624)",
        "config: training.deepspeed_overrides: keys ['optimizer'] are set from the training settings' own fields",
    ]


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("training.adam_beta1=1.0", "config: training.adam_beta1: Input should be less than 1 (got 1.0)"),
        ("training.adam_eps=0.0", "config: training.adam_eps: Input should be greater than 0 (got 0.0)"),
        ("training.weight_decay=-0.1", "config: training.weight_decay: Input should be greater than or equal to 0"),
        ("training.max_grad_norm=.inf", "config: training.max_grad_norm: Input should be a finite number (got inf)"),
        ("training.zero3_init=1", "config: training.zero3_init: Input should be a valid boolean (got 1)"),
        ("training.dist_timeout_s=0", "config: training.dist_timeout_s: Input should be greater than 0 (got 0)"),
        ("training.deepspeed_overrides=[1]", "config: training.deepspeed_overrides: Input should be a valid dict"),
    ],
)
def test_the_trainer_settings_the_config_gained_keep_their_rules(override: str, problem: str):
    with pytest.raises(ConfigError) as info:
        load_config("paper", [override], environ={})
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith(problem), info.value.problems


def test_the_gained_trainer_settings_default_to_the_reference_optimizer():
    training = load_config("paper", environ={}).training
    assert (training.adam_beta1, training.adam_beta2, training.adam_eps) == (0.9, 0.95, 1e-8)  # MASS_SPEC §8
    assert (training.weight_decay, training.max_grad_norm, training.zero3_init) == (0.0, 1.0, True)
    assert (training.deepspeed_overrides, training.dist_timeout_s) == ({}, 1800)

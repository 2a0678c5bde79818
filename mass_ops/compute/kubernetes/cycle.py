"""Every manifest a cycle creates, at once: for validation and dry runs (the operators build them one by one).

The one module of the package that imports the workload modules; none of them imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mass_ops.compute.kubernetes.common import WorkloadSettings
from mass_ops.compute.kubernetes.episode import EpisodeSpec, episode_pod
from mass_ops.compute.kubernetes.inference import (
    current_serving_target,
    inference_deployment,
    inference_service,
    next_serving_target,
)
from mass_ops.compute.kubernetes.training import rendezvous_service, training_job, training_trainjob
from mass_ops.config import CycleConfig


def manifests_of_cycle(
    config: CycleConfig, settings: WorkloadSettings, episodes: Sequence[EpisodeSpec]
) -> list[dict[str, Any]]:
    """Every manifest a cycle with these episodes creates (for validation and dry runs)."""
    scope = config.cycle_name
    targets = [current_serving_target(config), next_serving_target(config)]
    out: list[dict[str, Any]] = []
    for target in targets:
        out += [
            inference_deployment(config, settings, target, scope=scope),
            inference_service(config, settings, target, scope=scope),
        ]
    out += [episode_pod(config, settings, e) for e in episodes]
    if config.compute.kubernetes.training_launcher == "trainjob":
        out.append(training_trainjob(config, settings))
    else:
        out += [training_job(config, settings, role="train"), rendezvous_service(config, settings, role="train")]
    out += [training_job(config, settings, role="export"), rendezvous_service(config, settings, role="export")]
    return out

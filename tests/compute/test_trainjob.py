"""Training as a Kubeflow Trainer v2 TrainJob, and where every multi-node launch takes its master address from.

kubernetes-validate knows no CRD, so the TrainJob is checked against the fields of the Trainer v2 API as read in
kubeflow/trainer v2.2–v2.3 (`pkg/apis/trainer/v1alpha1/trainjob_types.go`, the torch plugin, the
`torch-distributed` ClusterTrainingRuntime), written down below as facts; the core/v1 parts it carries (env,
volumes, mounts, security contexts, resources, tolerations) are validated as what they are, inside a Pod.
"""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest

from mass_ops.compute import kubernetes as specs
from mass_ops.train.plan import MASTER_ADDR_ENVS, UNSET_MASTER_ADDR, master_address, training_command_for
from tests.compute.test_kubernetes_specs import EPISODES, GPU_VALUES, chart_settings_dir, cluster_config
from tests.deploy.chart_render import validate_manifest

# Field names per object of the TrainJob API (json tags); a key outside these is one the API server would drop or
# refuse. `{}` marks a field whose value is a core/v1 type (checked by kubernetes-validate instead).
CORE = {}
TRAINJOB_FIELDS: dict[str, Any] = {
    "apiVersion": None,
    "kind": None,
    "metadata": CORE,
    "spec": {
        "runtimeRef": {"name": None, "apiGroup": None, "kind": None},
        "initializer": CORE,
        "trainer": {
            "image": None,
            "command": None,
            "args": None,
            "env": CORE,
            "numNodes": None,
            "resourcesPerNode": CORE,
            "numProcPerNode": None,
        },
        "runtimePatches": [
            {
                "manager": None,
                "time": None,
                "trainingRuntimeSpec": {
                    "template": {
                        "metadata": {"labels": None, "annotations": None},
                        "spec": {
                            "replicatedJobs": [
                                {
                                    "name": None,
                                    "template": {
                                        "metadata": {"labels": None, "annotations": None},
                                        "spec": {
                                            "template": {
                                                "metadata": {"labels": None, "annotations": None},
                                                "spec": {
                                                    "serviceAccountName": None,
                                                    "volumes": CORE,
                                                    "initContainers": CORE,
                                                    "containers": [
                                                        {
                                                            "name": None,
                                                            "env": CORE,
                                                            "volumeMounts": CORE,
                                                            "securityContext": CORE,
                                                        }
                                                    ],
                                                    "imagePullSecrets": CORE,
                                                    "securityContext": CORE,
                                                    "nodeSelector": None,
                                                    "affinity": CORE,
                                                    "tolerations": CORE,
                                                    "schedulingGates": CORE,
                                                    "terminationGracePeriodSeconds": None,
                                                },
                                            }
                                        },
                                    },
                                }
                            ]
                        },
                    }
                },
            }
        ],
        "suspend": None,
        "activeDeadlineSeconds": None,
        "managedBy": None,
    },
}
TORCH_RESERVED_ENV = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
DOMAIN_PREFIXED_PATH = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+/[^/]\S*$")
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def unknown_fields(value: Any, allowed: Any, path: str = "") -> list[str]:
    """Paths in `value` that the API facts in `allowed` do not have."""
    if allowed is CORE or allowed is None:
        return []
    if isinstance(allowed, list):
        return [p for i, item in enumerate(value) for p in unknown_fields(item, allowed[0], f"{path}[{i}]")]
    found = []
    for key, item in value.items():
        if key not in allowed:
            found.append(f"{path}.{key}")
        else:
            found += unknown_fields(item, allowed[key], f"{path}.{key}")
    return found


@pytest.fixture(scope="module")
def chart_dir(tmp_path_factory):
    return chart_settings_dir(tmp_path_factory.mktemp("chart"), GPU_VALUES)


@pytest.fixture(scope="module")
def settings(chart_dir):
    return specs.load_workload_settings(chart_dir)


@pytest.fixture(scope="module")
def config(chart_dir):
    return cluster_config(
        chart_dir,
        "demo",
        "training.replicas=4",
        "training.nnodes=2",
        "training.gpus_per_node=2",
        "compute.kubernetes.training_launcher=trainjob",
    )


def node_patch(trainjob: dict[str, Any]) -> dict[str, Any]:
    [patch] = trainjob["spec"]["runtimePatches"]
    [job] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    return job


def test_trainjob_uses_only_fields_of_the_trainer_v2_api(config, settings):
    trainjob = specs.training_trainjob(config, settings)
    assert unknown_fields(trainjob, TRAINJOB_FIELDS) == []
    assert (trainjob["apiVersion"], trainjob["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    name = trainjob["metadata"]["name"]
    # The CRD's own rules: an RFC 1035 label of at most 63 characters; and JobSet names node pods
    # <name>-node-0-<index>, which must stay DNS labels too.
    assert DNS_1035.match(name) and len(f"{name}-node-0-99") <= 63
    assert trainjob["spec"]["runtimeRef"] == {
        "name": "torch-distributed", "apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
    }  # fmt: skip
    [patch] = trainjob["spec"]["runtimePatches"]
    assert DOMAIN_PREFIXED_PATH.match(patch["manager"]), "the webhook wants a domain-prefixed path"
    job = node_patch(trainjob)
    assert job["name"] == "node", "the torch runtimes name their trainer job `node`"
    containers = job["template"]["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["node"] and "env" not in containers[0]  # env only via trainer.env


def test_trainjob_runs_what_the_indexed_job_runs(config, settings):
    trainjob = specs.training_trainjob(config, settings)
    job = specs.training_job(config, settings, role="train")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    trainer = trainjob["spec"]["trainer"]
    assert trainer["numNodes"] == 2 == job["spec"]["completions"]
    assert trainer["numProcPerNode"] == 2 and trainer["resourcesPerNode"] == container["resources"]
    assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": "2"}
    assert (trainer["image"], trainer["command"]) == (container["image"], container["command"])
    # The same environment but MASTER_ADDR: the runtime sets PET_MASTER_ADDR, and its reserved names are not ours.
    job_env = [e for e in container["env"] if e["name"] != "MASTER_ADDR"]
    assert trainer["env"] == job_env and not {e["name"] for e in trainer["env"]} & TORCH_RESERVED_ENV
    template = node_patch(trainjob)["template"]["spec"]["template"]
    patched = template["spec"]
    assert patched["volumes"] == pod["volumes"]
    assert patched["containers"][0]["volumeMounts"] == container["volumeMounts"]
    assert patched["securityContext"] == pod["securityContext"] and patched["serviceAccountName"] == "mass-ops-workload"
    assert (patched["nodeSelector"], patched["tolerations"]) == (pod["nodeSelector"], pod["tolerations"])
    assert template["metadata"] == job["spec"]["template"]["metadata"], "labels the NetworkPolicy selects, config"


def test_trainjob_core_parts_validate_as_kubernetes_objects(config, settings):
    trainjob = specs.training_trainjob(config, settings)
    trainer = trainjob["spec"]["trainer"]
    template = node_patch(trainjob)["template"]["spec"]["template"]
    patched = template["spec"]
    node = patched["containers"][0]
    pod_spec = {key: value for key, value in patched.items() if key != "containers"}
    pod_spec["containers"] = [
        {
            "name": node["name"],
            "image": trainer["image"],
            "command": trainer["command"],
            "env": trainer["env"],
            "resources": trainer["resourcesPerNode"],
            "volumeMounts": node["volumeMounts"],
            "securityContext": node["securityContext"],
        }
    ]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "n", **template["metadata"]}, "spec": pod_spec}
    validate_manifest(pod)  # raises on any invalid or unknown field
    # The check has teeth: a misspelt field in the patch would be refused.
    broken = {**pod, "spec": {**pod_spec, "volumeMount": node["volumeMounts"]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_manifest(broken)


def test_a_cycle_on_trainjob_creates_no_training_job_or_service(config, settings):
    manifests = specs.manifests_of_cycle(config, settings, EPISODES[:1])
    kinds = [(m["kind"], m["metadata"]["name"]) for m in manifests]
    train = specs.job_name(config, "train")
    assert ("TrainJob", train) in kinds and ("Job", train) not in kinds and ("Service", train) not in kinds
    assert ("Job", specs.job_name(config, "export")) in kinds, "export stays a Job"
    for manifest in manifests:
        if manifest["kind"] != "TrainJob":
            validate_manifest(manifest)


def test_the_launcher_knob_defaults_to_the_indexed_job(chart_dir):
    assert cluster_config(chart_dir, "paper").compute.kubernetes.training_launcher == "indexed-job"
    with pytest.raises(ValueError, match="training_launcher"):
        cluster_config(chart_dir, "paper", "compute.kubernetes.training_launcher=mpi")


# --- the master address of a multi-node launch ---------------------------------------------------------------


def test_master_address_comes_from_the_pod_environment(config):
    script = training_command_for(config, environ={"PET_MASTER_ADDR": "mass-x-train-node-0-0.mass-x-train"})[-1]
    assert "--master_addr=mass-x-train-node-0-0.mass-x-train" in script  # a TrainJob's runtime
    both = {"MASTER_ADDR": "job-0.job", "PET_MASTER_ADDR": "other"}
    assert master_address(config, both) == "job-0.job" and MASTER_ADDR_ENVS[0] == "MASTER_ADDR"
    assert training_command_for(config, master_addr="given", environ=both)[-1].count("--master_addr=given") == 1


def test_without_the_variable_the_command_names_it_instead_of_guessing(config):
    script = training_command_for(config, environ={})[-1]
    assert f"--master_addr={UNSET_MASTER_ADDR}" in script and config.cycle_name.lower() not in script


def test_a_single_node_needs_no_master(chart_dir):
    single = cluster_config(chart_dir, "paper", "training.nnodes=1")
    assert master_address(single, {"MASTER_ADDR": "elsewhere"}) == "127.0.0.1"
    assert "--standalone" in training_command_for(single, environ={"MASTER_ADDR": "elsewhere"})

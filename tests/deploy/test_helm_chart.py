"""The mass-ops chart: renders with Helm's engine, every object validates, RBAC and the sandbox are exactly as meant."""

from __future__ import annotations

import copy
import tarfile
import tomllib
from pathlib import Path

import helm_python
import kubernetes_validate
import pytest
import yaml

from mass_ops.config import ComputeConfig, KubernetesConfig
from tests.deploy.chart_render import CHART_DIR, REPO_ROOT, RenderedChart, render_chart, validate_manifest

PRESETS_DIR = REPO_ROOT / "mass_ops" / "presets"
CHART_PRESETS_DIR = CHART_DIR / "files" / "presets"
AIRFLOW_EXAMPLE = CHART_DIR / "examples" / "airflow-values.yaml"
CHART_META = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text(encoding="utf-8"))
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))

# What the mass-ops operators call (plugins/mass_ops_airflow), per (API group, resource). pods/exec: none.
OPERATOR_VERBS: dict[tuple[str, str], set[str]] = {
    ("", "pods"): {"create", "delete", "get", "list", "watch", "patch"},
    ("", "pods/log"): {"get"},
    ("batch", "jobs"): {"create", "delete", "get", "list", "watch"},
    ("apps", "deployments"): {"create", "delete", "get", "list", "watch", "patch"},
    ("", "services"): {"create", "delete", "get", "list", "watch"},
    ("", "events"): {"get", "list", "watch"},
    ("trainer.kubeflow.org", "trainjobs"): {"create", "delete", "get", "watch"},
}

SECRET_ENV = {
    "MASS_METADATA_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_ENDPOINT_URL_S3",
    "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY",
    "VLLM_API_KEY",
}

FULL_VALUES = {
    "commonLabels": {"team": "research"},
    "images": {"episode": {"repository": "registry.local/mass/episode", "tag": "2025.1"}},
    "artifactUrl": "s3://lab-bucket/mass/prod",
    "s3Region": "eu-west-1",
    "secrets": {"s3": {"name": "minio-creds", "keys": {"AWS_ACCESS_KEY_ID": "accesskey"}}},
    "serviceAccounts": {"launcher": {"annotations": {"example.com/role": "launcher"}}},
    "rbac": {"extraSubjects": [{"kind": "ServiceAccount", "name": "airflow-triggerer"}]},
    "networkPolicy": {
        "inferencePort": 8011,
        "mirrors": [
            {"name": "pypi", "cidr": "10.40.0.0/24", "except": ["10.40.0.128/25"], "ports": [{"port": 443}]},
            {"name": "apt", "cidr": "10.41.0.0/16", "ports": [{"port": 80, "protocol": "TCP"}]},
        ],
    },
    "modelCache": {"storageClassName": "cephfs", "size": "2Ti", "accessModes": ["ReadWriteMany", "ReadOnlyMany"]},
    "trainingPriority": {"value": 5000, "preemptionPolicy": "Never"},
    "scheduling": {
        "nodeSelector": {"pool": "cpu"},
        "gpu": {
            "resource": "nvidia.com/gpu",
            # Helm merges maps with the defaults; null removes the default GPU label.
            "nodeSelector": {"gpu-type": "h200", "nvidia.com/gpu.present": None},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}],
        },
        "startupTimeoutSeconds": 600,
    },
    "episode": {"cpu": "2", "memory": "8Gi"},
}

MINIMAL_VALUES = {
    "serviceAccounts": {"launcher": {"create": False, "name": "airflow-worker"}, "workload": {"create": False}},
    "rbac": {"create": True},
    "networkPolicy": {"enabled": False},
    "modelCache": {"existingClaim": "shared-models"},
    "trainingPriority": {"create": False, "name": "gpu-batch"},
}


@pytest.fixture(scope="module")
def default_chart() -> RenderedChart:
    return render_chart()


def settings(chart: RenderedChart, key: str) -> dict:
    return yaml.safe_load(chart.one("ConfigMap", "mass-ops-settings")["data"][key])


def role_rules(chart: RenderedChart) -> dict[tuple[str, str], set[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in chart.one("Role")["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, f"unexpected rule fields: {rule}"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                key = (group, resource)
                assert key not in granted, f"{key} granted by two rules"
                granted[key] = set(rule["verbs"])
    return granted


# --- rendering and validation ---------------------------------------------------------------------------------


def test_default_render_has_every_object(default_chart):
    assert default_chart.names() == {
        ("ConfigMap", "mass-ops-presets"),
        ("ConfigMap", "mass-ops-settings"),
        ("ConfigMap", "mass-ops-env"),
        ("ServiceAccount", "mass-ops-launcher"),
        ("ServiceAccount", "mass-ops-workload"),
        ("Role", "mass-ops-launcher"),
        ("RoleBinding", "mass-ops-launcher"),
        ("NetworkPolicy", "mass-ops-episode-sandbox"),
        ("PersistentVolumeClaim", "mass-ops-model-cache"),
        ("PriorityClass", "mass-ops-training"),
    }
    assert not default_chart.of_kind("Secret"), "the chart must reference Secrets, never hold one"


@pytest.mark.parametrize("values", [{}, FULL_VALUES, MINIMAL_VALUES], ids=["defaults", "full", "minimal"])
def test_every_rendered_manifest_validates_against_kubernetes(values):
    chart = render_chart(values)
    assert chart.manifests
    for manifest in chart.manifests:
        validate_manifest(manifest)
        if manifest["kind"] != "PriorityClass":  # cluster-scoped
            assert manifest["metadata"]["namespace"] == "mass-ops"
        assert manifest["metadata"]["labels"]["app.kubernetes.io/part-of"] == "mass-ops"


def test_validation_is_live_and_strict():
    # A misspelt field must fail, so a passing validation above means something.
    bad = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "x"}, "automountToken": False}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_manifest(bad)


def test_names_follow_the_release(default_chart):
    chart = render_chart(release="prod", namespace="research")
    assert ("ConfigMap", "prod-mass-ops-settings") in chart.names()
    assert chart.one("RoleBinding")["subjects"][0] == {
        "kind": "ServiceAccount",
        "name": "prod-mass-ops-launcher",
        "namespace": "research",
    }
    kubernetes = yaml.safe_load(chart.one("ConfigMap", "prod-mass-ops-settings")["data"]["kubernetes.yaml"])
    assert kubernetes["compute"]["kubernetes"]["namespace"] == "research"
    assert kubernetes["compute"]["kubernetes"]["model_cache_pvc"] == "prod-mass-ops-model-cache"


def test_chart_lints_without_warnings():
    report = helm_python.lint(str(CHART_DIR), strict=True, kube_version="v1.33.0")
    assert report["errors"] == []
    serious = [m for m in report["messages"] if m["severity"] >= 2]
    assert serious == []


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"unknownKey": True}, "unknownKey"),
        ({"artifactUrl": "https://bucket/prefix"}, "/artifactUrl"),
        ({"networkPolicy": {"inferencePort": 70000}}, "/networkPolicy/inferencePort"),
        ({"networkPolicy": {"mirrors": [{"name": "m", "cidr": "10.0.0.1", "ports": [{"port": 443}]}]}}, "cidr"),
        ({"networkPolicy": {"mirrors": [{"name": "m", "cidr": "10.0.0.0/8", "ports": []}]}}, "ports"),
        ({"networkPolicy": {"publisher": {"storage": [{"name": "s3", "cidr": "10.0.0.1/32"}]}}}, "ports"),
        (
            {"networkPolicy": {"publisher": {"metadata": [{"name": "pg", "ports": [{"port": 5432}]}]}}},
            "/networkPolicy/publisher/metadata/0",
        ),
        (
            {
                "networkPolicy": {
                    "publisher": {
                        "metadata": [
                            {
                                "name": "pg",
                                "cidr": "10.0.0.5/32",
                                "podSelector": {"app": "pg"},
                                "ports": [{"port": 5432}],
                            },
                        ]
                    }
                }
            },
            "/networkPolicy/publisher/metadata/0",
        ),
        ({"episode": {"publisher": {"memory": "lots"}}}, "/episode/publisher/memory"),
        ({"training": {"launcher": "mpijob"}}, "/training/launcher"),
        ({"secrets": {"judges": {"keys": {"GITHUB_TOKEN": "t"}}}}, "GITHUB_TOKEN"),
        ({"secrets": {"metadata": {"name": "Bad_Name"}}}, "/secrets/metadata/name"),
        ({"rbac": {"extraSubjects": [{"kind": "User", "name": "alice"}]}}, "/rbac/extraSubjects/0/kind"),
        ({"trainingPriority": {"preemptionPolicy": "Always"}}, "/trainingPriority/preemptionPolicy"),
        ({"modelCache": {"accessModes": ["ReadWriteAlways"]}}, "/modelCache/accessModes/0"),
        ({"episode": {"cpu": "four"}}, "/episode/cpu"),
        ({"episode": {"ephemeralStorage": {"request": "1Gi", "limit": "lots"}}}, "/episode/ephemeralStorage/limit"),
        ({"episode": {"volumeSizeLimits": {"handoff": "-1"}}}, "/episode/volumeSizeLimits/handoff"),
        ({"episode": {"volumeSizeLimits": {"scratch": "1Gi"}}}, "scratch"),
        ({"episode": {"proxy": {"port": 80}}}, "/episode/proxy/port"),
        ({"episode": {"proxy": {"ephemeralStorage": {"request": "x"}}}}, "/episode/proxy/ephemeralStorage/request"),
        ({"scheduling": {"gpu": {"tolerations": [{"key": "k", "tolerationSeconds": 5}]}}}, "tolerationSeconds"),
    ],
)
def test_schema_rejects_bad_values_naming_the_key(values, where):
    with pytest.raises(helm_python.HelmValuesError) as caught:
        render_chart(values)
    assert where in str(caught.value)


# --- RBAC -----------------------------------------------------------------------------------------------------


def test_role_grants_exactly_the_operators_verbs(default_chart):
    assert role_rules(default_chart) == OPERATOR_VERBS


@pytest.mark.parametrize("values", [FULL_VALUES, MINIMAL_VALUES], ids=["full", "minimal"])
def test_values_can_add_subjects_but_never_permissions(values):
    chart = render_chart(values)
    assert role_rules(chart) == OPERATOR_VERBS
    assert not chart.of_kind("ClusterRole") and not chart.of_kind("ClusterRoleBinding")


def test_role_binding_binds_the_launcher_and_extra_subjects_only():
    chart = render_chart(FULL_VALUES)
    binding = chart.one("RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "mass-ops-launcher"}
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "mass-ops-launcher", "namespace": "mass-ops"},
        {"kind": "ServiceAccount", "name": "airflow-triggerer", "namespace": "mass-ops"},
    ]
    minimal = render_chart(MINIMAL_VALUES)
    assert not minimal.of_kind("ServiceAccount")
    assert minimal.one("RoleBinding")["subjects"][0]["name"] == "airflow-worker"


def test_service_accounts(default_chart):
    launcher = default_chart.one("ServiceAccount", "mass-ops-launcher")
    workload = default_chart.one("ServiceAccount", "mass-ops-workload")
    assert launcher.get("automountServiceAccountToken", True) is True
    assert workload["automountServiceAccountToken"] is False
    annotated = render_chart(FULL_VALUES).one("ServiceAccount", "mass-ops-launcher")
    assert annotated["metadata"]["annotations"] == {"example.com/role": "launcher"}


# --- the episode sandbox --------------------------------------------------------------------------------------


def test_network_policy_confines_episode_pods(default_chart):
    policy = default_chart.one("NetworkPolicy")["spec"]
    assert policy["podSelector"] == {"matchLabels": {"mass-ops/role": "episode"}}
    assert sorted(policy["policyTypes"]) == ["Egress", "Ingress"]
    assert policy.get("ingress", []) == [], "episode pods accept no connection"
    inference, dns = policy["egress"]
    assert inference == {
        "to": [{"podSelector": {"matchLabels": {"app.kubernetes.io/component": "inference"}}}],
        "ports": [{"protocol": "TCP", "port": 8001}],
    }
    assert dns == {
        "to": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
            }
        ],
        "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
    }


def test_network_policy_adds_mirrors_and_never_an_open_rule():
    policy = render_chart(FULL_VALUES).one("NetworkPolicy")["spec"]
    inference, _dns, pypi, apt = policy["egress"]
    assert inference["ports"] == [{"protocol": "TCP", "port": 8011}]
    assert pypi == {
        "to": [{"ipBlock": {"cidr": "10.40.0.0/24", "except": ["10.40.0.128/25"]}}],
        "ports": [{"protocol": "TCP", "port": 443}],
    }
    assert apt == {"to": [{"ipBlock": {"cidr": "10.41.0.0/16"}}], "ports": [{"protocol": "TCP", "port": 80}]}
    for rule in policy["egress"]:
        # A rule without `to` or without `ports` would open every destination or every port.
        assert rule.get("to") and rule.get("ports"), rule


def test_network_policy_opens_the_publishers_targets_and_nothing_wider():
    values = {
        "networkPolicy": {
            "publisher": {
                "storage": [{"name": "minio", "cidr": "10.50.0.10/32", "ports": [{"port": 9000}]}],
                "metadata": [
                    {
                        "name": "postgres",
                        "namespaceSelector": {"kubernetes.io/metadata.name": "databases"},
                        "podSelector": {"cnpg.io/cluster": "mass-ops"},
                        "ports": [{"port": 5432}],
                    }
                ],
            }
        }
    }
    chart = render_chart(values)
    policy = chart.one("NetworkPolicy")
    validate_manifest(policy)
    _inference, _dns, *publisher = policy["spec"]["egress"]
    assert publisher == [
        {
            "to": [
                {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "databases"}},
                    "podSelector": {"matchLabels": {"cnpg.io/cluster": "mass-ops"}},
                }
            ],
            "ports": [{"protocol": "TCP", "port": 5432}],
        },
        {"to": [{"ipBlock": {"cidr": "10.50.0.10/32"}}], "ports": [{"protocol": "TCP", "port": 9000}]},
    ]
    assert "WARNING" not in chart.notes


def test_notes_warn_when_episode_pods_cannot_publish(default_chart):
    assert "networkPolicy.publisher.storage is empty" in default_chart.notes
    only_storage = {
        "networkPolicy": {"publisher": {"storage": [{"name": "s", "cidr": "10.0.0.1/32", "ports": [{"port": 443}]}]}}
    }
    assert "networkPolicy.publisher.metadata is empty" in render_chart(only_storage).notes
    assert "WARNING" not in render_chart(MINIMAL_VALUES).notes, "no policy, nothing blocked"


def test_workload_labels_match_what_the_policy_selects(default_chart):
    labels = settings(default_chart, "workloads.yaml")["labels"]
    policy = default_chart.one("NetworkPolicy")["spec"]
    assert labels == {
        "episode": {"app.kubernetes.io/component": "episode", "mass-ops/role": "episode"},
        "inference": {"app.kubernetes.io/component": "inference"},
        "training": {"app.kubernetes.io/component": "training"},
    }
    assert policy["podSelector"]["matchLabels"].items() <= labels["episode"].items()
    assert policy["egress"][0]["to"][0]["podSelector"]["matchLabels"] == labels["inference"]


# --- presets --------------------------------------------------------------------------------------------------


def test_chart_preset_copies_are_identical_to_the_package_presets():
    package = {p.name: p.read_bytes() for p in PRESETS_DIR.glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in CHART_PRESETS_DIR.glob("*.yaml")}
    assert package, "no presets found in mass_ops/presets"
    assert sorted(chart) == sorted(package), "helm/mass-ops/files/presets must hold exactly mass_ops/presets/*.yaml"
    drifted = [name for name in package if chart[name] != package[name]]
    assert drifted == [], f"copy mass_ops/presets/{drifted} to helm/mass-ops/files/presets/"


def test_presets_config_map_carries_every_preset_verbatim(default_chart):
    data = default_chart.one("ConfigMap", "mass-ops-presets")["data"]
    assert data == {p.name: p.read_text(encoding="utf-8") for p in PRESETS_DIR.glob("*.yaml")}


# --- settings for the operators --------------------------------------------------------------------------------


def test_kubernetes_settings_are_a_valid_compute_section_naming_the_rendered_objects(default_chart):
    section = settings(default_chart, "kubernetes.yaml")
    compute = ComputeConfig.model_validate(section["compute"])
    assert compute.backend == "kubernetes"
    k8s = compute.kubernetes
    assert ("PersistentVolumeClaim", k8s.model_cache_pvc) in default_chart.names()
    assert ("PriorityClass", k8s.training_priority_class) in default_chart.names()
    # Installed as release mass-ops in namespace mass-ops, the chart agrees with the config's own defaults.
    defaults = KubernetesConfig()
    for field in ("namespace", "image_episode", "image_trainer", "image_inference", "gpu_resource",
                  "model_cache_pvc", "episode_cpu", "episode_memory", "publisher_cpu", "publisher_memory",
                  "startup_timeout_s", "training_priority_class", "training_launcher",
                  "trainjob_runtime"):  # fmt: skip
        assert getattr(k8s, field) == getattr(defaults, field), field
    assert k8s.image_episode.endswith(f":{CHART_META['appVersion']}")
    assert CHART_META["appVersion"] == PYPROJECT["project"]["version"]


def test_gpu_scheduling_and_overrides_reach_the_settings():
    chart = render_chart(FULL_VALUES)
    k8s = KubernetesConfig.model_validate(settings(chart, "kubernetes.yaml")["compute"]["kubernetes"])
    assert k8s.gpu_node_selector == {"gpu-type": "h200"}
    assert k8s.gpu_tolerations == [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}]
    assert k8s.node_selector == {"pool": "cpu"}
    assert k8s.image_episode == "registry.local/mass/episode:2025.1"
    assert k8s.image_trainer == f"ghcr.io/mass-ops/trainer:{CHART_META['appVersion']}"
    assert (k8s.episode_cpu, k8s.episode_memory, k8s.startup_timeout_s) == ("2", "8Gi", 600)
    default_gpu = KubernetesConfig.model_validate(settings(render_chart(), "kubernetes.yaml")["compute"]["kubernetes"])
    assert default_gpu.gpu_node_selector and default_gpu.gpu_tolerations, "GPU pods need a selector by default"


def test_episode_pods_get_disk_limits_from_the_values(default_chart, tmp_path):
    """ISSUE #13.6: the chart carries the episode pods' ephemeral-storage budgets and emptyDir sizeLimits, with safe
    defaults, and the operators' settings reader turns them into the pod builder's limits."""
    from mass_ops.compute.kubernetes import DEFAULT_EPISODE_VOLUME_LIMITS, EpisodeLimits, load_workload_settings

    limits = settings(default_chart, "workloads.yaml")["episodeLimits"]
    assert limits["sandboxStorage"] == {"request": "2Gi", "limit": "24Gi"}
    assert limits["publisherStorage"] == {"request": "256Mi", "limit": "2Gi"}
    assert limits["proxyStorage"] == {"request": "64Mi", "limit": "1Gi"}
    assert limits["volumeSizeLimits"] == DEFAULT_EPISODE_VOLUME_LIMITS
    assert (limits["proxyCpu"], limits["proxyMemory"], limits["proxyPort"]) == ("500m", "512Mi", 8470)

    chart = render_chart(
        {
            "episode": {
                "ephemeralStorage": {"request": "1Gi", "limit": "10Gi"},
                "volumeSizeLimits": {"handoff": "3Gi"},
                "proxy": {"port": 9100},
            }
        }
    )
    folder = tmp_path
    for name, text in chart.one("ConfigMap", "mass-ops-settings")["data"].items():
        (folder / name).write_text(text)
    read = load_workload_settings(folder).episode_limits
    assert (read.sandbox_storage.request, read.sandbox_storage.limit) == ("1Gi", "10Gi")
    assert read.size_limit("handoff") == "3Gi" and read.size_limit("workspace") == "8Gi"  # merged with defaults
    assert read.proxy_port == 9100
    assert load_workload_settings(folder / "absent").episode_limits == EpisodeLimits()


def test_secret_refs_cover_every_credential_with_least_privilege(default_chart):
    refs = settings(default_chart, "secret-refs.yaml")
    assert set(refs) == SECRET_ENV
    assert refs["MASS_METADATA_URL"] == {
        "secretName": "mass-ops-metadata",
        "key": "MASS_METADATA_URL",
        "optional": False,
        "consumers": ["airflow", "training", "publisher"],
    }
    # The agent runs arbitrary commands in episode pods: its container gets no secret; the pod's proxy container
    # gets the model-server key and nothing else; the publisher container gets the stores' credentials and no key.
    assert {env for env, ref in refs.items() if "episode" in ref["consumers"]} == set()
    assert {env for env, ref in refs.items() if "proxy" in ref["consumers"]} == {"VLLM_API_KEY"}
    assert {env for env, ref in refs.items() if "publisher" in ref["consumers"]} == {
        "MASS_METADATA_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL_S3",
    }  # fmt: skip
    assert {env for env, ref in refs.items() if "inference" in ref["consumers"]} == {"VLLM_API_KEY"}
    assert all("airflow" in ref["consumers"] for ref in refs.values())
    judges = {env for env, ref in refs.items() if ref["secretName"] == "mass-ops-judges"}
    assert judges == {"OPENAI_API_KEY", "ANTHROPIC_API_KEY"}
    assert all(refs[env]["consumers"] == ["airflow"] for env in judges)


def test_secret_names_and_keys_come_from_values():
    refs = settings(render_chart(FULL_VALUES), "secret-refs.yaml")
    assert refs["AWS_ACCESS_KEY_ID"] == {
        "secretName": "minio-creds",
        "key": "accesskey",
        "optional": False,
        "consumers": ["airflow", "training", "publisher"],
    }
    assert refs["AWS_SECRET_ACCESS_KEY"]["secretName"] == "minio-creds"
    assert refs["AWS_SECRET_ACCESS_KEY"]["key"] == "AWS_SECRET_ACCESS_KEY"


def test_env_config_map(default_chart):
    assert default_chart.one("ConfigMap", "mass-ops-env")["data"] == {"MASS_ARTIFACT_URL": "s3://mass-ops/artifacts"}
    full = render_chart(FULL_VALUES).one("ConfigMap", "mass-ops-env")["data"]
    assert full == {
        "MASS_ARTIFACT_URL": "s3://lab-bucket/mass/prod",
        "AWS_DEFAULT_REGION": "eu-west-1",
        "AWS_REGION": "eu-west-1",
    }


def test_model_cache_claim(default_chart):
    claim = default_chart.one("PersistentVolumeClaim")
    assert claim["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert "storageClassName" not in claim["spec"], "empty means the cluster default class"
    sized = render_chart(FULL_VALUES).one("PersistentVolumeClaim")["spec"]
    assert sized["storageClassName"] == "cephfs" and sized["resources"]["requests"]["storage"] == "2Ti"
    existing = render_chart(MINIMAL_VALUES)
    assert not existing.of_kind("PersistentVolumeClaim")
    assert settings(existing, "kubernetes.yaml")["compute"]["kubernetes"]["model_cache_pvc"] == "shared-models"


def test_training_priority_class(default_chart):
    priority = default_chart.one("PriorityClass")
    assert priority["globalDefault"] is False and priority["preemptionPolicy"] == "PreemptLowerPriority"
    assert "namespace" not in priority["metadata"]
    external = render_chart(MINIMAL_VALUES)
    assert not external.of_kind("PriorityClass")
    assert settings(external, "kubernetes.yaml")["compute"]["kubernetes"]["training_priority_class"] == "gpu-batch"


# --- the companion Airflow release ------------------------------------------------------------------------------


def _example_env() -> dict[str, dict]:
    example = yaml.safe_load(AIRFLOW_EXAMPLE.read_text(encoding="utf-8"))
    return {item["name"]: item["valueFrom"]["secretKeyRef"] for item in yaml.safe_load(example["extraEnv"])}


def test_airflow_example_values_point_at_the_rendered_objects(default_chart):
    example = yaml.safe_load(AIRFLOW_EXAMPLE.read_text(encoding="utf-8"))
    names = default_chart.names()
    for component in ("workers", "triggerer"):
        account = example[component]["serviceAccount"]
        assert account["create"] is False and ("ServiceAccount", account["name"]) in names
        assert account["name"] in {s["name"] for s in default_chart.one("RoleBinding")["subjects"]}
    for source in yaml.safe_load(example["extraEnvFrom"]):
        assert ("ConfigMap", source["configMapRef"]["name"]) in names
    for volume in example["volumes"]:
        assert ("ConfigMap", volume["configMap"]["name"]) in names
    assert {m["name"] for m in example["volumeMounts"]} == {v["name"] for v in example["volumes"]}
    assert example["airflowVersion"] == example["defaultAirflowTag"]
    airflow_pin = next(r for r in PYPROJECT["project"]["optional-dependencies"]["airflow"] if "apache-airflow==" in r)
    assert example["airflowVersion"] == airflow_pin.split("==")[1]
    assert example["images"]["airflow"]["tag"] == PYPROJECT["project"]["version"]


def test_airflow_example_injects_exactly_the_airflow_secret_refs(default_chart):
    refs = settings(default_chart, "secret-refs.yaml")
    expected = {
        env: {"name": ref["secretName"], "key": ref["key"], "optional": ref["optional"]}
        for env, ref in refs.items()
        if "airflow" in ref["consumers"]
    }
    assert _example_env() == expected


def test_notes_name_every_secret_without_values(default_chart):
    refs = settings(default_chart, "secret-refs.yaml")
    for env, ref in refs.items():
        assert f"{ref['secretName']} / {ref['key']}" in default_chart.notes, env


def test_values_file_defaults_render_the_same_as_no_values(default_chart):
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text(encoding="utf-8"))
    explicit = render_chart(copy.deepcopy(values))
    assert explicit.manifests == default_chart.manifests


def test_packaged_chart_ships_readme_example_schema_and_presets(tmp_path):
    archive = Path(helm_python.package(str(CHART_DIR), destination=str(tmp_path)))
    assert archive.name == f"mass-ops-{CHART_META['version']}.tgz"
    with tarfile.open(archive) as packed:
        members = set(packed.getnames())
    expected = {"README.md", "examples/airflow-values.yaml", "values.schema.json", "templates/rbac.yaml"}
    expected |= {f"files/presets/{p.name}" for p in PRESETS_DIR.glob("*.yaml")}
    assert {f"mass-ops/{name}" for name in expected} <= members

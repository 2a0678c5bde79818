"""Every manifest the operators create validates against Kubernetes 1.33 and keeps the sandbox and GPU contracts.

The workload settings come from the Helm chart itself (its settings ConfigMap rendered by Helm's engine), so these
tests also pin the contract between the chart and the spec builders: labels the NetworkPolicy selects, the workload
service account, which Secret reaches which workload.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import kubernetes_validate
import pytest

from mass_ops.compute import kubernetes as specs
from mass_ops.compute.kubernetes import EpisodeSpec, SpecError, WorkloadSettings, load_workload_settings
from mass_ops.config import load_config
from mass_ops.layout import EpisodeUnit
from mass_ops.runtime.episode import EpisodeRequest
from mass_ops.train.plan import training_command_for
from tests.deploy.chart_render import REPO_ROOT, render_chart, validate_manifest

SERVE_SH = REPO_ROOT / "docker" / "inference" / "serve.sh"
GPU_VALUES = {
    "scheduling": {
        "nodeSelector": {"pool": "cpu"},
        "gpu": {
            "nodeSelector": {"gpu-type": "h200"},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}],
        },
    },
}


def stage_request(spec: EpisodeSpec, seed: int, condition: str) -> EpisodeRequest:
    """A request as a stage builds it for the unit `spec` names (rollout replicates sit in the unit's candidate)."""
    unit = EpisodeUnit(
        "c", spec.task_id, spec.kind, seed, spec.version, spec.unit_candidate, generation=spec.generation
    )
    return EpisodeRequest(unit, condition, f"the prompt of {spec.slug}\n")


def bound(spec: EpisodeSpec, seed: int, condition: str) -> EpisodeSpec:
    request = stage_request(spec, seed, condition)
    return spec.bound(request, f"s3://bucket/mass/cycles/c/prompts/{request.prompt_sha256}.txt")


EPISODES = [
    bound(EpisodeSpec("reference", 51), 450051, "t51_bare"),
    bound(EpisodeSpec("search", 51, version=3), 453051, "t51_v3"),
    bound(EpisodeSpec("collection", 202, candidate=17), 700 + 20217, "t202_L0"),
    bound(EpisodeSpec("rollout", 60, replicate=9, generation="L1"), 916009, "t60_bare"),
]


def chart_settings_dir(tmp_path: Path, values: dict | None = None) -> Path:
    """The chart's settings ConfigMap written out as the mounted folder the operators read."""
    data = render_chart(values).one("ConfigMap", "mass-ops-settings")["data"]
    folder = tmp_path / "settings"
    folder.mkdir()
    for name, text in data.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture(scope="module")
def chart_dir(tmp_path_factory) -> Path:
    return chart_settings_dir(tmp_path_factory.mktemp("chart"), GPU_VALUES)


@pytest.fixture(scope="module")
def settings(chart_dir) -> WorkloadSettings:
    return load_workload_settings(chart_dir)


def cluster_config(chart_dir: Path, preset: str = "paper", *overrides: str):
    """A preset on the chart's cluster settings (what the DAG builds in-cluster)."""
    import yaml

    compute = yaml.safe_load((chart_dir / "kubernetes.yaml").read_text())["compute"]
    sets = [f"compute={json.dumps(compute)}", *overrides]
    return load_config(preset, sets)


@pytest.fixture(scope="module")
def paper(chart_dir):
    return cluster_config(chart_dir, "paper", "training.nnodes=3")  # the paper's 3 ranks, one per node


def test_every_manifest_of_a_cycle_validates(chart_dir, settings):
    variants = (
        ("paper", ["training.nnodes=3"]),
        ("cycle2", []),
        ("demo", ["inference.server.gpus=2", "training.replicas=4", "training.nnodes=2"]),
    )
    for preset, extra in variants:
        config = cluster_config(chart_dir, preset, *extra)
        manifests = specs.manifests_of_cycle(config, settings, EPISODES)
        assert {m["kind"] for m in manifests} == {"Deployment", "Service", "Pod", "Job"}
        for manifest in manifests:
            validate_manifest(manifest)
            assert manifest["metadata"]["namespace"] == config.compute.kubernetes.namespace
            assert len(manifest["metadata"]["name"]) <= 63


def test_validation_catches_a_broken_manifest(paper, settings):
    pod = specs.episode_pod(paper, settings, EPISODES[0])
    broken = copy.deepcopy(pod)
    broken["spec"]["containers"][0]["securityContext"]["runAsNonroot"] = True  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_manifest(broken)


# --- episode sandbox --------------------------------------------------------------------------------------------


def test_episode_pod_is_a_sandbox(paper, settings):
    pod = specs.episode_pod(paper, settings, EPISODES[1])
    spec = pod["spec"]
    container, publisher = spec["containers"]
    assert (container["name"], publisher["name"]) == ("base", specs.PUBLISHER_CONTAINER)
    assert spec["automountServiceAccountToken"] is False
    assert spec["serviceAccountName"] == "mass-ops-workload"
    assert spec["enableServiceLinks"] is False
    assert spec["restartPolicy"] == "Never"
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False and security["privileged"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    k8s = paper.compute.kubernetes
    assert container["resources"] == {
        "requests": {"cpu": k8s.episode_cpu, "memory": k8s.episode_memory, "ephemeral-storage": "2Gi"},
        "limits": {"cpu": k8s.episode_cpu, "memory": k8s.episode_memory, "ephemeral-storage": "24Gi"},
    }
    assert "tolerations" not in spec and spec["nodeSelector"] == {"pool": "cpu"}  # CPU nodes, no GPU
    # The paper sets no wall-clock limit on an episode (MASS_SPEC §4), so neither does its pod.
    assert paper.runtime.episode_wall_clock_s is None and "activeDeadlineSeconds" not in spec
    sha = EPISODES[1].prompt_sha256
    assert container["command"] == [
        "mass-ops", "episode", "run", "--config", specs.CONFIG_FILE, "--kind", "search", "--task", "51",
        "--seed", "453051", "--version", "3", "--condition", "t51_v3", "--prompt-file", "/handoff/prompt.txt",
        "--handoff", specs.HANDOFF_MOUNT,
    ]  # fmt: skip
    assert publisher["command"] == [
        "mass-ops", "episode", "publish", "--config", specs.CONFIG_FILE, "--handoff", specs.HANDOFF_MOUNT,
        "--prompt-uri", f"s3://bucket/mass/cycles/c/prompts/{sha}.txt", "--prompt-sha256", sha,
        "--proxy-control", "/proxy-logs/control.sock", "--proxy-sessions", "/proxy-logs/sessions",
    ]  # fmt: skip


def test_episode_pod_shares_only_the_handoff_folder(paper, settings):
    spec = specs.episode_pod(paper, settings, EPISODES[1])["spec"]
    sandbox, publisher = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {c["name"]: {m["name"]: m for m in c["volumeMounts"]} for c in (sandbox, publisher)}
    shared = set(mounts["base"]) & set(mounts["publisher"])
    assert shared == {"handoff", "cycle-config"} and volumes["handoff"]["emptyDir"] == {"sizeLimit": "12Gi"}
    assert mounts["base"]["handoff"]["mountPath"] == mounts["publisher"]["handoff"]["mountPath"] == specs.HANDOFF_MOUNT
    assert mounts["publisher"]["cycle-config"]["readOnly"] is True
    # Two regular containers (see episode_pod's docstring), no process namespace in common; the proxy sidecar shares
    # its folder (control socket, session logs) with the publisher only (ISSUE #25.4): the sandbox has no way to it.
    [proxy] = spec["initContainers"]
    assert proxy["name"] == specs.PROXY_CONTAINER and proxy["restartPolicy"] == "Always"
    assert [m["name"] for m in proxy["volumeMounts"]] == ["proxy-logs"] and "proxy-logs" not in mounts["base"]
    assert mounts["publisher"]["proxy-logs"] == {"name": "proxy-logs", "mountPath": "/proxy-logs", "readOnly": True}
    assert proxy["securityContext"]["readOnlyRootFilesystem"]
    assert not any("proxy" in e["name"].lower() or "/proxy-logs" in str(e.get("value")) for e in sandbox["env"])
    assert not spec.get("shareProcessNamespace", False)
    for container in (sandbox, publisher):
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False and security["runAsNonRoot"] is True
        assert security["capabilities"] == {"drop": ["ALL"]} and security["privileged"] is False
    assert publisher["securityContext"]["readOnlyRootFilesystem"] is True
    assert mounts["publisher"]["publisher-tmp"]["mountPath"] == "/tmp" and "publisher-tmp" not in mounts["base"]
    k8s = paper.compute.kubernetes
    assert publisher["resources"]["limits"] == {
        "cpu": k8s.publisher_cpu, "memory": k8s.publisher_memory, "ephemeral-storage": "2Gi",
    }  # fmt: skip
    assert publisher["image"] == sandbox["image"] == k8s.image_episode


def test_episode_pod_carries_what_the_network_policy_selects(paper, settings):
    chart = render_chart(GPU_VALUES)
    selected = chart.one("NetworkPolicy")["spec"]["podSelector"]["matchLabels"]
    for episode in EPISODES:
        labels = specs.episode_pod(paper, settings, episode)["metadata"]["labels"]
        assert selected.items() <= labels.items()
        assert labels["app.kubernetes.io/part-of"] == "mass-ops"
    inference_labels = specs.inference_deployment(paper, settings, specs.current_serving_target(paper), scope="c")
    pod_labels = inference_labels["spec"]["template"]["metadata"]["labels"]
    egress_to = chart.one("NetworkPolicy")["spec"]["egress"][0]["to"][0]["podSelector"]["matchLabels"]
    assert egress_to.items() <= pod_labels.items(), "episodes must be allowed to reach the inference pods"


def test_episode_sandbox_holds_no_secret_the_proxy_the_key_and_the_publisher_the_stores(paper, settings):
    """ISSUE #13.4: the agent's container has no secret env, envFrom or volume; the key is the proxy's alone."""
    spec = specs.episode_pod(paper, settings, EPISODES[1])["spec"]
    sandbox, publisher = spec["containers"]
    [proxy] = spec["initContainers"]
    assert not [e for e in sandbox["env"] if "valueFrom" in e] and "envFrom" not in sandbox
    assert "VLLM_API_KEY" not in json.dumps(sandbox)
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in sandbox["volumeMounts"]:
        volume = volumes[mount["name"]]
        assert not {"secret", "projected"} & set(volume), f"the sandbox mounts {mount['name']}, a secret volume"
    proxy_secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in proxy["env"] if "valueFrom" in e}
    assert proxy_secrets == {"VLLM_API_KEY": {"name": "mass-ops-inference", "key": "VLLM_API_KEY", "optional": True}}
    assert "envFrom" not in proxy
    assert proxy["command"] == [
        "/opt/mass-ops/bin/python", "-m", "mass_ops.runtime.session_proxy", "--listen", "8470",
        "--sessions-dir", "/proxy-logs/sessions", "--control-socket", "/proxy-logs/control.sock",
        "--key-env", "VLLM_API_KEY", "--upstream", "http://127.0.0.1:8001",
        "--allow-host-suffix", f".{paper.compute.kubernetes.namespace}.svc", "--port-file", "/proxy-logs/proxy.port",
        "--client-path", "/v1", "--max-request-bytes", str(32 * 1024**2),
    ]  # fmt: skip
    assert proxy["startupProbe"]["exec"]["command"] == ["/usr/bin/test", "-s", "/proxy-logs/proxy.port"]
    # Not even the store's URL: the sandbox learns what it needs from the publisher's ledger.
    assert not {e["name"] for e in sandbox["env"]} & {"MASS_METADATA_URL", "MASS_ARTIFACT_URL", "AWS_ACCESS_KEY_ID"}
    publisher_secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in publisher["env"] if "valueFrom" in e}
    assert set(publisher_secrets) == {
        "MASS_METADATA_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL_S3",
    }  # fmt: skip
    assert publisher_secrets["MASS_METADATA_URL"]["name"] == "mass-ops-metadata"
    assert publisher["envFrom"] == [{"configMapRef": {"name": "mass-ops-env"}}]


def test_a_priority_scheduling_server_and_each_episode_s_proxy_get_the_critical_path_order(chart_dir, settings, paper):
    """ISSUE #17.2: the vLLM server schedules by priority, and each episode pod's proxy (not its sandbox) stamps the
    episode's place on the chain on every request: search versions first, collection next, rollouts last."""
    config = cluster_config(chart_dir, "paper", "inference.server.scheduling_policy=priority")
    target = specs.current_serving_target(config)
    [server] = specs.inference_deployment(config, settings, target, scope="c")["spec"]["template"]["spec"]["containers"]
    assert {"name": "MASS_SERVE_SCHEDULING_POLICY", "value": "priority"} in server["env"]
    stamped = []
    for episode in EPISODES:
        spec = specs.episode_pod(config, settings, episode)["spec"]
        [proxy] = spec["initContainers"]
        assert proxy["command"][-2] == "--request-priority"
        assert "--request-priority" not in json.dumps(spec["containers"]), "the sandbox must not choose its priority"
        stamped.append(int(proxy["command"][-1]))
    assert stamped == [0, 3, 12, 13]  # reference, search v3, collection, rollout (paper: 11 iterations)
    # First come, first served (the reference's server): no priority anywhere.
    [proxy] = specs.episode_pod(paper, settings, EPISODES[1])["spec"]["initContainers"]
    assert "--request-priority" not in proxy["command"]


def test_pods_receive_the_config_without_storage(chart_dir, settings):
    config = cluster_config(chart_dir, "paper", "storage.metadata_url=postgresql://mass:hunter2@db.internal/mass")
    pod = specs.episode_pod(config, settings, EPISODES[0])
    document = pod["metadata"]["annotations"][specs.CONFIG_ANNOTATION]
    assert "hunter2" not in document and "storage" not in json.loads(document)
    assert json.loads(document)["search"]["seed_base"] == config.search.seed_base
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "cycle-config")
    assert volume["downwardAPI"]["items"][0]["fieldRef"]["fieldPath"] == (
        f"metadata.annotations['{specs.CONFIG_ANNOTATION}']"
    )
    for container in pod["spec"]["containers"]:
        assert str(Path(specs.CONFIG_FILE).parent) in {m["mountPath"] for m in container["volumeMounts"]}
    assert "/workspace" in {m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}


def test_episode_specs_need_their_identity():
    with pytest.raises(SpecError, match="search episode needs version"):
        EpisodeSpec("search", 51)
    with pytest.raises(SpecError, match="rollout episode needs replicate"):
        EpisodeSpec("rollout", 51, generation="L1")
    assert EpisodeSpec("rollout", 60, replicate=2, generation="L1").slug == "rollout-L1-t60-r2"


def flags(command: list[str]) -> dict[str, str]:
    """`--flag value` pairs of a container command (every flag of `episode run/publish` here takes a value)."""
    start = next(i for i, arg in enumerate(command) if arg.startswith("--"))
    pairs = command[start:]
    assert len(pairs) % 2 == 0 and all(flag.startswith("--") for flag in pairs[::2]), command
    return dict(zip(pairs[::2], pairs[1::2], strict=True))


@pytest.mark.parametrize("episode", EPISODES, ids=lambda e: e.kind)
def test_each_kind_runs_the_seed_condition_and_prompt_it_was_bound_to(paper, settings, episode):
    sandbox, publisher = specs.episode_pod(paper, settings, episode)["spec"]["containers"]
    run, publish = flags(sandbox["command"]), flags(publisher["command"])
    # What the sandbox's `episode run` rebuilds from its flags is the request the spec was bound to.
    request = stage_request(episode, episode.seed, episode.condition)  # type: ignore[arg-type]
    unit = EpisodeUnit(
        "c",
        int(run["--task"]),
        run["--kind"],  # type: ignore[arg-type]
        int(run["--seed"]),
        int(run["--version"]) if "--version" in run else None,
        int(run["--candidate"]) if "--candidate" in run else None,
        generation=run.get("--generation"),
    )
    assert unit == request.unit and run["--condition"] == request.condition
    assert "--replicate" not in run, "episode run has no --replicate: a rollout's replicate is the unit's candidate"
    assert run["--prompt-file"] == f"{specs.HANDOFF_MOUNT}/prompt.txt" and run["--handoff"] == specs.HANDOFF_MOUNT
    assert publish["--prompt-sha256"] == request.prompt_sha256 == episode.prompt_sha256
    assert publish["--prompt-uri"] == episode.prompt_uri and publish["--handoff"] == specs.HANDOFF_MOUNT


def test_only_a_bound_spec_becomes_a_pod(paper, settings):
    identity = EpisodeSpec("collection", 202, candidate=17)
    with pytest.raises(SpecError, match=r"collection-t202-c17: no seed, condition or prompt yet"):
        specs.episode_pod(paper, settings, identity)
    other = stage_request(EpisodeSpec("collection", 202, candidate=16), 20216, "t202_L0")
    with pytest.raises(SpecError, match=r"collection-t202-c17: the request is for another unit \(collection-t202-c16"):
        identity.bound(other, "s3://b/p.txt")
    with pytest.raises(SpecError, match="come together"):
        EpisodeSpec("reference", 51, seed=1)
    with pytest.raises(SpecError, match="not a hex SHA-256"):
        EpisodeSpec("reference", 51, seed=1, condition="t51_bare", prompt_uri="s3://b/p.txt", prompt_sha256="abc")


# --- inference server ---------------------------------------------------------------------------------------------


def serve_sh_variables() -> set[str]:
    return set(re.findall(r"\$\{(MASS_SERVE_[A-Z_]+)", SERVE_SH.read_text()))


def test_vllm_deployment_carries_the_serving_flags(paper, settings):
    target = specs.current_serving_target(paper)
    deployment = specs.inference_deployment(paper, settings, target, scope=paper.cycle_name)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    server = paper.inference.server
    assert env["MASS_SERVE_MODEL"] == "/models/L0-fp8"
    assert env["MASS_SERVE_NAME"] == "Qwen/Qwen3.6-27B-FP8"
    assert env["MASS_SERVE_PORT"] == "8001"
    assert env["MASS_SERVE_MAX_MODEL_LEN"] == "262144"
    assert env["MASS_SERVE_TOOL_CALL_PARSER"] == "qwen3_coder"
    assert env["MASS_SERVE_REASONING_PARSER"] == "qwen3"
    assert env["MASS_SERVE_MAX_NUM_SEQS"] == str(server.max_num_seqs)
    assert float(env["MASS_SERVE_GPU_MEMORY_UTILIZATION"]) == server.gpu_memory_utilization
    assert "MASS_SERVE_TENSOR_PARALLEL_SIZE" not in env
    set_here = {name for name in env if name.startswith("MASS_SERVE_")}
    assert set_here <= serve_sh_variables(), "every MASS_SERVE_* we set must be one serve.sh reads"
    assert {e["name"] for e in container["env"] if "valueFrom" in e} == {"VLLM_API_KEY"}
    assert "command" not in container and "args" not in container, "the image's entry point (serve.sh) runs"


def test_vllm_pod_resources_volumes_and_probes(paper, settings):
    deployment = specs.inference_deployment(paper, settings, specs.next_serving_target(paper), scope="c")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"] == {"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory"}
    assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "mass-ops-model-cache", "readOnly": True}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/dev/shm"]["name"] == "dshm" and mounts["/models"]["readOnly"] is True
    assert (
        pod["nodeSelector"] == paper.compute.kubernetes.gpu_node_selector and pod["nodeSelector"]["gpu-type"] == "h200"
    )
    assert pod["tolerations"] == GPU_VALUES["scheduling"]["gpu"]["tolerations"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= paper.inference.server.readiness_timeout_s
    assert container["ports"] == [{"name": "http", "containerPort": 8001, "protocol": "TCP"}]
    assert pod["automountServiceAccountToken"] is False and pod["securityContext"]["runAsNonRoot"] is True
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MASS_SERVE_MODEL"] == "/models/L1-fp8" and env["MASS_SERVE_NAME"] == "L1"


def test_service_selects_exactly_its_deployment(paper, settings):
    current, nxt = specs.current_serving_target(paper), specs.next_serving_target(paper)
    deployment = specs.inference_deployment(paper, settings, current, scope=paper.cycle_name)
    service = specs.inference_service(paper, settings, current, scope=paper.cycle_name)
    other = specs.inference_deployment(paper, settings, nxt, scope=paper.cycle_name)
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    assert service["spec"]["selector"].items() <= template_labels.items()
    other_labels = other["spec"]["template"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= other_labels.items()
    assert service["spec"]["ports"][0]["port"] == paper.inference.server.port
    url = specs.inference_url(paper, paper.cycle_name, current.served_name)
    assert url == f"http://{service['metadata']['name']}.mass-ops.svc:8001/v1"


def test_multi_gpu_serving_sets_tensor_parallelism(chart_dir, settings):
    config = cluster_config(chart_dir, "paper", "inference.server.gpus=4")
    container = specs.inference_deployment(config, settings, specs.current_serving_target(config), scope="c")["spec"][
        "template"
    ]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MASS_SERVE_TENSOR_PARALLEL_SIZE"] == "4"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "4"}


def test_the_served_tensor_parallel_size_is_the_one_the_export_checked(chart_dir, settings):
    """`inference.tensor_parallel_size` (what the FP8 export's divisibility check used) wins over the GPU count."""
    config = cluster_config(chart_dir, "paper", "inference.server.gpus=4", "inference.tensor_parallel_size=2")
    container = specs.inference_deployment(config, settings, specs.current_serving_target(config), scope="c")["spec"][
        "template"
    ]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MASS_SERVE_TENSOR_PARALLEL_SIZE"] == "2"


# --- training and export Jobs -------------------------------------------------------------------------------------


def test_training_is_an_indexed_job_with_a_rendezvous_service(paper, settings):
    job = specs.training_job(paper, settings, role="train")
    service = specs.rendezvous_service(paper, settings, role="train")
    name = job["metadata"]["name"]
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == (
        "Indexed", 3, 3, 0,
    )  # fmt: skip
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NNODES"]["value"] == "3" and env["NPROC_PER_NODE"]["value"] == "1"  # 3 replicas over 3 nodes
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    assert env["MASTER_ADDR"]["value"] == f"{name}-0.{service['metadata']['name']}"
    # The command each node runs takes node 0's address from that variable, not from a name of its own.
    script = training_command_for(paper, environ={"MASTER_ADDR": env["MASTER_ADDR"]["value"]})[-1]
    assert f"--master_addr={name}-0.{name}" in script and "JOB_COMPLETION_INDEX" in script
    assert pod["subdomain"] == service["metadata"]["name"] == name
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": name}
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert pod["priorityClassName"] == "mass-ops-training"
    assert pod["tolerations"] and pod["nodeSelector"] == paper.compute.kubernetes.gpu_node_selector
    assert container["command"] == ["mass-ops", "stage", "train", "--config", specs.CONFIG_FILE]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["model-cache"]["persistentVolumeClaim"]["readOnly"] is True
    assert len(name) + len("-99") <= 63, "pod hostnames <job>-<index> must stay DNS labels"


def test_gpus_per_pod_follow_ranks_per_node(chart_dir, settings):
    config = cluster_config(chart_dir, "demo", "training.replicas=4", "training.nnodes=2", "training.gpus_per_node=2")
    container = specs.training_job(config, settings)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert (env["NNODES"], env["NPROC_PER_NODE"]) == ("2", "2")
    assert container["resources"]["requests"] == {"nvidia.com/gpu": "2"}


def test_training_gets_storage_secrets_but_never_judge_keys(paper, settings):
    container = specs.training_job(paper, settings)["spec"]["template"]["spec"]["containers"][0]
    secret_envs = {e["name"] for e in container["env"] if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]}
    assert secret_envs == {"MASS_METADATA_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL_S3"}


def test_export_job_is_one_pod_writing_the_model_cache(paper, settings):
    job = specs.training_job(paper, settings, role="export")
    assert job["spec"]["completions"] == 1 and job["metadata"]["name"] != specs.job_name(paper, "train")
    pod = job["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"]["readOnly"] is False
    assert pod["containers"][0]["command"][:3] == ["mass-ops", "stage", "export"]


# --- names, settings, model keys -----------------------------------------------------------------------------------


def test_resource_names_are_dns_labels_and_stable():
    long_a = specs.resource_name("vllm", "a" * 80, "Qwen/Qwen3.6-27B-FP8")
    long_b = specs.resource_name("vllm", "a" * 80, "Qwen/Qwen3.6-27B-FP9")
    for name in (long_a, long_b, specs.resource_name("9lives", "X_y.z")):
        assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", name), name
    assert long_a != long_b and long_a == specs.resource_name("vllm", "a" * 80, "Qwen/Qwen3.6-27B-FP8")
    assert specs.label_value("cycle-") == "cycle" and len(specs.label_value("x" * 100)) == 63


def test_model_keys_map_into_the_cache():
    assert specs.model_path("models/L1-fp8") == "/models/L1-fp8"
    assert specs.model_path("teams/a/L1-fp8") == "/models/teams/a/L1-fp8"
    for bad in ("s3://bucket/models/L1", "/abs/path", "models/../etc"):
        with pytest.raises(SpecError):
            specs.model_path(bad)


def test_current_target_needs_a_bf16_parent(chart_dir):
    config = cluster_config(chart_dir, "paper", "models.parent_bf16=models/base")
    with pytest.raises(SpecError, match="must end in -bf16"):
        specs.current_serving_target(config)
    cycle2 = cluster_config(chart_dir, "cycle2")
    assert specs.current_serving_target(cycle2) == specs.ServingTarget("L1", "models/L1-fp8")
    assert specs.next_serving_target(cycle2) == specs.ServingTarget("L2", "models/L2-fp8")


def test_settings_default_without_a_folder_and_fail_on_garbage(tmp_path, monkeypatch):
    monkeypatch.delenv(specs.SETTINGS_DIR_ENV, raising=False)
    assert load_workload_settings(tmp_path / "absent") == WorkloadSettings()
    (tmp_path / "secret-refs.yaml").write_text("VLLM_API_KEY: {key: only}\n")
    with pytest.raises(SpecError, match="lacks secretName"):
        load_workload_settings(tmp_path)
    monkeypatch.setenv(specs.SETTINGS_DIR_ENV, str(tmp_path / "absent"))
    assert specs.settings_dir() == tmp_path / "absent"


def test_chart_settings_round_trip(settings):
    assert settings.service_account == "mass-ops-workload"
    assert settings.labels_for("episode") == {"app.kubernetes.io/component": "episode", "mass-ops/role": "episode"}
    consumers = {ref.env: set(ref.consumers) for ref in settings.secret_refs}
    assert {env for env, who in consumers.items() if "proxy" in who} == {"VLLM_API_KEY"}
    assert {env for env, who in consumers.items() if "episode" in who} == set()


def test_every_episode_volume_and_container_has_a_disk_limit(paper, settings):
    """ISSUE #13.6: no emptyDir without a sizeLimit, no container without an ephemeral-storage request and limit."""
    spec = specs.episode_pod(paper, settings, EPISODES[0])["spec"]
    for volume in spec["volumes"]:
        if "emptyDir" in volume:
            assert volume["emptyDir"].get("sizeLimit"), f"emptyDir {volume['name']} has no sizeLimit"
    for container in [*spec["initContainers"], *spec["containers"]]:
        resources = container["resources"]
        name = container["name"]
        assert resources["requests"]["ephemeral-storage"] and resources["limits"]["ephemeral-storage"], name
    validate_manifest(specs.episode_pod(paper, settings, EPISODES[0]))


def test_episode_limits_come_from_the_settings_and_bad_ones_are_one_line(paper, tmp_path):
    limits = specs.EpisodeLimits(
        sandbox_storage=specs.DiskBudget("1Gi", "5Gi"), volume_size_limits={"handoff": "3Gi"}, proxy_port=9000
    )
    spec = specs.episode_pod(paper, WorkloadSettings(episode_limits=limits), EPISODES[0])["spec"]
    sandbox = spec["containers"][0]
    assert sandbox["resources"]["limits"]["ephemeral-storage"] == "5Gi"
    sizes = {v["name"]: v["emptyDir"]["sizeLimit"] for v in spec["volumes"] if "emptyDir" in v}
    assert sizes["handoff"] == "3Gi" and sizes["workspace"] == "8Gi"
    [proxy] = spec["initContainers"]
    assert proxy["command"][proxy["command"].index("--listen") + 1] == "9000"
    for broken, message in (
        ({"sandbox_storage": specs.DiskBudget("9Gi", "1Gi")}, "request 9Gi exceeds limit 1Gi"),
        ({"volume_size_limits": {"handoff": "lots"}}, "episode.volumeSizeLimits.handoff 'lots' is not"),
        ({"volume_size_limits": {"scratch": "1Gi"}}, "unknown volumes ['scratch']"),
        ({"proxy_port": 80}, "episode.proxy.port 80"),
    ):
        with pytest.raises(SpecError) as caught:
            specs.EpisodeLimits(**broken)
        assert message in str(caught.value) and "\n" not in str(caught.value)
    (tmp_path / "workloads.yaml").write_text("episodeLimits: {sandboxStorage: {request: 3Gi, limit: 2Gi}}\n")
    with pytest.raises(SpecError, match="exceeds limit"):
        load_workload_settings(tmp_path)


def test_a_wall_clock_limit_bounds_the_pod_and_none_leaves_it_unbounded(chart_dir, settings):
    demo = cluster_config(chart_dir, "demo")
    spec = specs.episode_pod(demo, settings, EPISODES[0])["spec"]
    assert demo.runtime.episode_wall_clock_s == 600
    assert spec["activeDeadlineSeconds"] == 600 * demo.runtime.max_infra_attempts + 900
    unbounded = cluster_config(chart_dir, "demo", "runtime.episode_wall_clock_s=null")
    assert "activeDeadlineSeconds" not in specs.episode_pod(unbounded, settings, EPISODES[0])["spec"]
    assert specs.episode_deadline_s(unbounded) is None


# --- benchmark grader Jobs (#18.2) ---------------------------------------------------------------------------------


def swe_grader_job():
    from mass_ops.evaluation.benchmarks.swe import grader_job
    from tests.evaluation.benchmarks.test_adapters import PATCH, SWE_INSTANCE

    return grader_job(SWE_INSTANCE, PATCH)


def test_benchmark_grader_job_validates_and_is_bounded_like_an_episode(paper, settings):
    job = swe_grader_job()
    sha = "ab" * 32
    manifest = specs.benchmark_grader_job(paper, settings, job, bundle_uri="s3://b/grader/x.tar", bundle_sha256=sha)
    validate_manifest(manifest)
    episode = specs.episode_pod(paper, settings, EPISODES[0])
    pod, episode_spec = manifest["spec"]["template"]["spec"], episode["spec"]
    assert manifest["kind"] == "Job" and manifest["spec"]["backoffLimit"] == 0
    assert manifest["spec"]["activeDeadlineSeconds"] == 1800 + specs.GRADER_DEADLINE_SLACK_S
    assert len(manifest["metadata"]["name"]) <= 63
    # The chart's sandbox NetworkPolicy selects it exactly as it selects episode pods.
    labels = manifest["spec"]["template"]["metadata"]["labels"]
    assert settings.labels_for("episode").items() <= labels.items()
    assert labels["mass-ops/benchmark"] == "swe" and labels["mass-ops/instance"] == "calc__calc-1"
    [fetch], [grader] = pod["initContainers"], pod["containers"]
    sandbox = episode_spec["containers"][0]
    assert grader["image"] == "registry.local/swebench/calc-1:latest"
    assert grader["resources"] == sandbox["resources"]  # the episode sandbox's CPU, memory and disk limits
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    assert pod["serviceAccountName"] == episode_spec["serviceAccountName"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod.get("nodeSelector") == episode_spec.get("nodeSelector") and "tolerations" not in pod
    assert all("sizeLimit" in v["emptyDir"] for v in pod["volumes"] if "emptyDir" in v)
    # Root in the benchmark's image, but with nothing beyond it: no escalation, no capability, no Secret.
    assert grader["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": False,
        "runAsNonRoot": False,
        "runAsUser": 0,
        "capabilities": {"drop": ["ALL"]},
    }
    assert "envFrom" not in grader and all("valueFrom" not in e for e in grader["env"])
    assert {"name": "MASS_GRADER_SCRIPT", "value": job.script} in grader["env"]
    # The bundle's fetch: the episode image as the runtime user, the publisher's store credentials only.
    assert fetch["image"] == paper.compute.kubernetes.image_episode
    assert fetch["securityContext"]["runAsNonRoot"] is True and fetch["securityContext"]["runAsUser"] == 10001
    assert fetch["command"][-6:] == ["--uri", "s3://b/grader/x.tar", "--sha256", sha, "--out", specs.GRADER_BUNDLE]
    secret_env = sorted(e["name"] for e in fetch["env"] if "valueFrom" in e)
    assert secret_env == sorted(e["name"] for e in settings.secret_env("publisher"))
    assert [m["readOnly"] for m in grader["volumeMounts"] if m["name"] == "grader-in"] == [True]


def test_benchmark_grader_job_refuses_what_cannot_run(paper, settings):
    job = swe_grader_job()
    with pytest.raises(SpecError, match="is not a hex SHA-256"):
        specs.benchmark_grader_job(paper, settings, job, bundle_uri="s3://b/x.tar", bundle_sha256="nope")
    from dataclasses import replace

    with pytest.raises(SpecError, match="timeout_s"):
        specs.benchmark_grader_job(
            paper, settings, replace(job, timeout_s=0.0), bundle_uri="s3://b/x.tar", bundle_sha256="ab" * 32
        )


def test_benchmark_grader_jobs_of_one_instance_in_two_trials_have_two_names(paper, settings):
    job = swe_grader_job()
    names = {
        specs.benchmark_grader_job(paper, settings, job, bundle_uri="s3://b/x.tar", bundle_sha256="ab" * 32, unit=u)[
            "metadata"
        ]["name"]
        for u in ("l1-t0", "l1-t1", "l2-t0")
    }
    assert len(names) == 3 and all(len(n) <= 52 for n in names)
    assert specs.grader_job_name(paper, job, "l1-t0") in names
    labels = specs.benchmark_grader_job(
        paper, settings, job, bundle_uri="s3://b/x.tar", bundle_sha256="ab" * 32, unit="L1-t0"
    )["metadata"]["labels"]
    assert labels["mass-ops/unit"] == "L1-t0"  # what a retry's wait for the old Job selects


# --- benchmark episode pods (#18.2) ----------------------------------------------------------------------------------

BENCHMARK_EPISODE = bound(EpisodeSpec("benchmark", "swe_django__django-11099", candidate=2, generation="L1"), 31, "x")
L1_SERVER = specs.EpisodeServer("http://vllm-c-l1.mass-ops.svc:8000/v1", "L1")


def test_a_benchmark_episode_is_named_by_its_task_and_needs_its_trial_and_generation():
    assert BENCHMARK_EPISODE.slug == "benchmark-L1-tswe_django__django-11099-c2"
    with pytest.raises(SpecError, match="benchmark episode needs candidate"):
        EpisodeSpec("benchmark", "tb2_hello", generation="L1")
    with pytest.raises(SpecError, match="needs the generation it runs"):
        EpisodeSpec("benchmark", "tb2_hello", candidate=0)
    for name in ("tb2 hello", "../etc", "", 7, "tb2_" + "x" * 300):
        with pytest.raises(SpecError, match="is not a benchmark task name"):
            EpisodeSpec("benchmark", name, candidate=0, generation="L1")  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="task_id must be a positive whole number"):
        EpisodeSpec("reference", "51")  # type: ignore[arg-type]


def test_a_benchmark_episode_pod_validates_with_its_time_limit_and_server(paper, settings):
    pod = specs.episode_pod(paper, settings, BENCHMARK_EPISODE, wall_clock_s=1200, server=L1_SERVER)
    validate_manifest(pod)
    assert len(pod["metadata"]["name"]) <= 63
    sandbox, publisher = pod["spec"]["containers"]
    run = flags(sandbox["command"])
    assert (run["--kind"], run["--task"], run["--candidate"], run["--generation"]) == (
        "benchmark", "swe_django__django-11099", "2", "L1",
    )  # fmt: skip
    assert (run["--wall-clock-s"], run["--endpoint"], run["--served-name"]) == ("1200", L1_SERVER.endpoint, "L1")
    # The publisher opens the proxy session towards that server itself (the sandbox names no upstream).
    publish = flags(publisher["command"])
    assert (publish["--endpoint"], publish["--served-name"]) == (L1_SERVER.endpoint, "L1")
    assert pod["spec"]["activeDeadlineSeconds"] == 1200 * paper.runtime.max_infra_attempts + 900
    # The same sandbox as every episode: its label, the same image and limits; the key only in the proxy.
    plain = specs.episode_pod(paper, settings, EPISODES[0])
    assert pod["metadata"]["labels"]["mass-ops/role"] == plain["metadata"]["labels"]["mass-ops/role"] == "episode"
    assert pod["metadata"]["labels"]["mass-ops/task"] == "swe_django__django-11099"
    assert sandbox["image"] == plain["spec"]["containers"][0]["image"]
    assert sandbox["resources"] == plain["spec"]["containers"][0]["resources"]
    assert pod["spec"]["initContainers"] == plain["spec"]["initContainers"]
    assert pod["metadata"]["annotations"] == plain["metadata"]["annotations"], "the config stays the cycle's"
    assert "valueFrom" not in json.dumps(sandbox) and publisher["name"] == specs.PUBLISHER_CONTAINER


def test_only_a_benchmark_episode_takes_run_options_and_they_must_be_sound(paper, settings):
    with pytest.raises(SpecError, match="only a benchmark episode takes its own time limit or server"):
        specs.episode_pod(paper, settings, EPISODES[0], wall_clock_s=60)
    with pytest.raises(SpecError, match="wall_clock_s must be a whole number of seconds"):
        specs.episode_pod(paper, settings, BENCHMARK_EPISODE, wall_clock_s=0)
    with pytest.raises(SpecError, match="is not a plain http"):
        specs.EpisodeServer("ftp://x/v1", "L1")
    assert (
        "--wall-clock-s"
        not in specs.episode_pod(paper, settings, BENCHMARK_EPISODE)["spec"]["containers"][0]["command"]
    )

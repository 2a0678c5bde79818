"""The container images: hadolint clean, pinned, non-root, no baked secrets, and in step with the code's pins."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from mass_ops.runtime import qwen_install
from tests.deploy.dockerfile import Dockerfile, Instruction, copy_sources, read_dockerfile

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
HADOLINT_CONFIG = DOCKER / ".hadolint.yaml"
SERVE_SH = DOCKER / "inference" / "serve.sh"
BIN = Path(sys.executable).parent
IMAGES = ("airflow", "episode", "trainer", "inference")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
# Paths that must never be let into a build context: local state, credentials, caches, model weights.
NEVER_IN_CONTEXT = (".env", ".venv", ".git", ".runtime", "runs", "models", "benchmarks", "tests")
SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSW|CREDENTIAL|AUTH", re.IGNORECASE)


def dockerfile(image: str) -> Dockerfile:
    return read_dockerfile(DOCKER / image / "Dockerfile")


def extra_pin(extra: str, package: str) -> str:
    """Version of `package==X` in the pyproject extra `extra`."""
    for requirement in PYPROJECT["project"]["optional-dependencies"][extra]:
        name, sep, version = requirement.partition("==")
        if name.strip() == package and sep:
            return version.strip()
    raise AssertionError(f"pyproject extra [{extra}] pins no {package}==")


def hadolint(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "hadolint"), "--config", str(HADOLINT_CONFIG), "--no-color", "--format", "json", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def test_docker_holds_exactly_the_four_images():
    found = sorted(p.parent.name for p in DOCKER.glob("*/Dockerfile"))
    assert found == sorted(IMAGES)


@pytest.mark.parametrize("image", IMAGES)
def test_hadolint_finds_nothing(image):
    result = hadolint(str(DOCKER / image / "Dockerfile"))
    findings = json.loads(result.stdout or "[]")
    assert findings == [], "\n".join(f"{f['line']}: {f['code']} {f['message']}" for f in findings)
    assert result.returncode == 0, result.stderr


def test_hadolint_with_our_config_does_fail_a_bad_dockerfile(tmp_path):
    # Proves the lint gate is live: an unpinned, untrusted, root image must produce findings under our config.
    bad = tmp_path / "Dockerfile"
    bad.write_text(
        "FROM python:latest\nRUN apt-get update && apt-get install -y curl\n"
        "FROM quay.io/example/tool:1.0\nRUN pip install requests\n",
        encoding="utf-8",
    )
    result = hadolint(str(bad))
    codes = {finding["code"] for finding in json.loads(result.stdout)}
    assert {"DL3007", "DL3008", "DL3026", "DL3013"} <= codes
    assert result.returncode != 0


@pytest.mark.parametrize("image", IMAGES)
def test_every_base_image_is_pinned_to_a_version(image):
    parsed = dockerfile(image)
    earlier: set[str] = set()
    for stage in parsed.stages:
        if stage.base in earlier:
            continue
        assert "$" not in stage.base, f"{image}: base {stage.base} is chosen by a build argument"
        repository, _, tag = stage.base.rpartition(":")
        assert repository and "/" not in tag, f"{image}: base {stage.base} has no tag"
        assert tag != "latest" and re.search(r"\d+\.\d+", tag), f"{image}: base {stage.base} is not a version tag"
        if stage.name:
            earlier.add(stage.name)


def test_base_images_are_the_documented_releases():
    airflow = extra_pin("airflow", "apache-airflow")
    assert {s.base for s in dockerfile("airflow").stages} == {f"apache/airflow:{airflow}-python3.11"}
    node_stage = dockerfile("episode").stages[0]
    assert node_stage.base.startswith(f"node:{qwen_install.NODE_MAJOR}.")
    assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+", dockerfile("inference").final.base)


@pytest.mark.parametrize("image", IMAGES)
def test_final_stage_runs_as_a_numeric_non_root_user(image):
    final = dockerfile(image).final
    users = final.all("USER")
    assert users, f"{image}: the final stage sets no USER"
    last = users[-1]
    assert last.text.isdigit(), f"{image}: USER {last.text} is not numeric, so runAsNonRoot cannot verify it"
    assert int(last.text) != 0, f"{image}: runs as root"


@pytest.mark.parametrize("image", ["episode", "trainer", "inference"])
def test_the_runtime_user_is_created_with_that_uid(image):
    final = dockerfile(image).final
    uid = final.all("USER")[-1].text
    created = " ".join(i.text for i in final.all("RUN"))
    assert re.search(rf"useradd\b[^&]*--uid {uid}\b", created), f"{image}: no useradd --uid {uid}"


@pytest.mark.parametrize("image", IMAGES)
def test_no_credentials_are_baked_in(image):
    parsed = dockerfile(image)
    for stage in parsed.stages:
        for name in [*stage.args(), *stage.env(), *parsed.global_args]:
            assert not SECRET_NAME.search(name), f"{image}: ARG/ENV {name} could carry a credential into a layer"
        for instruction in stage.all("COPY") + stage.all("ADD"):
            assert "from" in instruction.flags or not any(
                Path(src).name.startswith(".env") for src in copy_sources(instruction)
            ), f"{image}: copies an env file"
        assert not stage.all("ADD"), f"{image}: ADD can fetch remote content; use COPY"


def _allowed_by_ignore_file(image: str) -> list[str]:
    lines = (DOCKER / image / "Dockerfile.dockerignore").read_text(encoding="utf-8").splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    assert patterns[0] == "*", f"{image}: the ignore file must start by excluding everything"
    return [p[1:].rstrip("/") for p in patterns if p.startswith("!")]


def _context_copies(parsed: Dockerfile) -> list[tuple[Instruction, str]]:
    return [
        (instruction, source)
        for stage in parsed.stages
        for instruction in stage.all("COPY")
        if "from" not in instruction.flags
        for source in copy_sources(instruction)
    ]


@pytest.mark.parametrize("image", IMAGES)
def test_build_context_lets_in_only_what_is_copied(image):
    allowed = _allowed_by_ignore_file(image)
    for entry in allowed:
        assert not any(entry == bad or entry.startswith(f"{bad}/") for bad in NEVER_IN_CONTEXT), entry
    copied = {source.rstrip("/") for _, source in _context_copies(dockerfile(image))}
    assert copied == set(allowed), f"{image}: ignore file lets in {sorted(allowed)} but COPY uses {sorted(copied)}"


@pytest.mark.parametrize("image", IMAGES)
def test_copied_sources_exist_in_the_repository(image):
    for instruction, source in _context_copies(dockerfile(image)):
        assert (ROOT / source).exists(), f"{image} line {instruction.line}: COPY source {source} does not exist"


def _context_copy(image: str, into: Path) -> Path:
    """What BuildKit would send for `image`: the allowlisted paths, without caches and build leftovers."""
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for entry in _allowed_by_ignore_file(image):
        source = ROOT / entry
        if source.is_dir():
            shutil.copytree(source, into / entry, ignore=junk)
        else:
            (into / entry).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / entry)
    return into


@pytest.mark.slow
def test_mass_ops_wheel_builds_from_the_image_context_under_the_name_the_images_install(tmp_path):
    # The wheels stage sees only the allowlisted files; building from exactly those proves nothing is missing, and
    # the wheel's file name is what the final stages bind-mount and install.
    context = _context_copy("episode", tmp_path / "context")
    wheels = tmp_path / "wheels"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "--quiet",
         "--wheel-dir", str(wheels), str(context)],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    built = [p.name for p in wheels.glob("*.whl")]
    for image in ("airflow", "episode", "trainer"):
        final = dockerfile(image).final
        name = f"mass_ops-{final.args()['MASS_OPS_VERSION']}-py3-none-any.whl"
        assert built == [name], f"{image} installs {name}, the build produced {built}"
        assert any("/tmp/wheels/mass_ops-${MASS_OPS_VERSION}-py3-none-any.whl" in i.text for i in final.all("RUN"))


def test_plugin_package_builds_the_wheel_the_airflow_image_installs():
    manifest = ROOT / "plugins" / "pyproject.toml"
    assert manifest.is_file(), "the airflow image builds plugins/ as a package: plugins/pyproject.toml is missing"
    project = tomllib.loads(manifest.read_text(encoding="utf-8"))["project"]
    wheel_prefix = re.sub(r"[-_.]+", "_", project["name"]).lower()
    assert wheel_prefix == "mass_ops_airflow"
    install = " ".join(i.text for i in dockerfile("airflow").final.all("RUN"))
    assert f"/tmp/wheels/{wheel_prefix}-*.whl" in install


@pytest.mark.parametrize("image", IMAGES)
def test_mass_ops_version_matches_pyproject(image):
    assert dockerfile(image).final.args()["MASS_OPS_VERSION"] == PYPROJECT["project"]["version"]


def test_airflow_image_pins_airflow_and_installs_our_packages():
    parsed = dockerfile("airflow")
    final = parsed.final
    assert final.args()["AIRFLOW_VERSION"] == extra_pin("airflow", "apache-airflow")
    install = " ".join(i.text for i in final.all("RUN"))
    assert '"apache-airflow==${AIRFLOW_VERSION}"' in install
    assert "[airflow]" in install and "mass_ops_airflow-" in install
    wheels = " ".join(i.text for i in parsed.stages[0].all("RUN"))
    assert "/home/airflow/src/plugins" in wheels
    assert any(i.text.endswith("/opt/airflow/dags/") for i in final.all("COPY"))


def test_episode_image_matches_the_qwen_runtime_layout():
    parsed = dockerfile("episode")
    node_stage = parsed.stages[0]
    assert node_stage.args()["QWEN_CODE_VERSION"] == qwen_install.QWEN_CODE_VERSION
    runtime_dir = parsed.final.env()[qwen_install.RUNTIME_DIR_ENV]
    assert runtime_dir == "/opt/mass-runtime"
    npm = " ".join(i.text for i in node_stage.all("RUN"))
    assert f"--prefix {runtime_dir}/qwen " in npm
    assert f'"{qwen_install.QWEN_CODE_PACKAGE}@${{QWEN_CODE_VERSION}}"' in npm
    copied = {i.text.split()[-1] for i in parsed.final.all("COPY") if i.flags.get("from") == node_stage.name}
    assert {f"{runtime_dir}/qwen", "/usr/local/bin/node"} <= copied
    run = " ".join(i.text for i in parsed.final.all("RUN"))
    assert '"uv==${UV_VERSION}"' in run and re.fullmatch(r"\d+\.\d+\.\d+", parsed.final.args()["UV_VERSION"])
    # The install lock is the only runtime file the unprivileged user may write.
    assert f"-o mass -g mass /dev/null {runtime_dir}/.install.lock" in run


def test_trainer_image_installs_the_pinned_torch_from_the_cuda_index_then_deepspeed():
    final = dockerfile("trainer").final
    args = final.args()
    assert args["TORCH_VERSION"] == extra_pin("train", "torch")
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", args["TORCH_INDEX_URL"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["DEEPSPEED_VERSION"])
    run = " && ".join(i.text for i in final.all("RUN"))
    torch_at = run.index('"torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"')
    deepspeed_at = run.index('--no-build-isolation "deepspeed==${DEEPSPEED_VERSION}"')
    train_at = run.index("[train]")
    assert torch_at < deepspeed_at < train_at


def test_inference_image_runs_the_launch_script():
    final = dockerfile("inference").final
    (copy,) = final.all("COPY")
    assert copy.text == "docker/inference/serve.sh /usr/local/bin/mass-serve" and copy.flags["chmod"] == "0755"
    assert final.all("ENTRYPOINT")[-1].text == '["/usr/local/bin/mass-serve"]'
    assert os.access(SERVE_SH, os.X_OK)


# --- docker/inference/serve.sh ------------------------------------------------------------------------------------

EXPECTED_DEFAULT_ARGV = [
    "serve", "/models/L1-fp8",
    "--served-model-name", "L1",
    "--host", "0.0.0.0",
    "--port", "8001",
    "--max-model-len", "262144",
    "--enable-auto-tool-choice",
    "--tool-call-parser", "qwen3_coder",
    "--reasoning-parser", "qwen3",
    "--max-num-seqs", "4",
    "--gpu-memory-utilization", "0.90",
    "--scheduling-policy", "fcfs",
]  # fmt: skip


@pytest.fixture
def fake_vllm(tmp_path):
    """A `vllm` on PATH that records its argv and whether it received VLLM_API_KEY, instead of serving."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "record.json"
    script = bin_dir / "vllm"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'key': os.environ.get('VLLM_API_KEY')}}, open({str(record)!r}, 'w'))\n",
        encoding="utf-8",
    )
    script.chmod(0o755)

    def run(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], dict | None]:
        full_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", **env}
        result = subprocess.run(
            ["bash", str(SERVE_SH), *args], env=full_env, capture_output=True, text=True, check=False, timeout=30
        )
        recorded = json.loads(record.read_text()) if record.exists() else None
        return result, recorded

    return run


MODEL_ENV = {"MASS_SERVE_MODEL": "/models/L1-fp8", "MASS_SERVE_NAME": "L1"}


def test_serve_defaults_are_the_spec_flags(fake_vllm):
    result, recorded = fake_vllm(MODEL_ENV)
    assert result.returncode == 0, result.stderr
    assert recorded == {"argv": EXPECTED_DEFAULT_ARGV, "key": None}
    assert "api key: off" in result.stderr


def test_serve_takes_every_parameter_from_the_environment_and_passes_extra_args(fake_vllm):
    env = {
        **MODEL_ENV,
        "MASS_SERVE_HOST": "127.0.0.1",
        "MASS_SERVE_PORT": "8011",
        "MASS_SERVE_MAX_MODEL_LEN": "65536",
        "MASS_SERVE_TOOL_CALL_PARSER": "hermes",
        "MASS_SERVE_REASONING_PARSER": "deepseek_r1",
        "MASS_SERVE_MAX_NUM_SEQS": "2",
        "MASS_SERVE_GPU_MEMORY_UTILIZATION": "0.85",
        "MASS_SERVE_TENSOR_PARALLEL_SIZE": "2",
        "MASS_SERVE_SCHEDULING_POLICY": "priority",
    }
    result, recorded = fake_vllm(env, "--enforce-eager")
    assert result.returncode == 0, result.stderr
    argv = recorded["argv"]
    assert argv[:2] == ["serve", "/models/L1-fp8"]
    for flag, value in [
        ("--host", "127.0.0.1"),
        ("--port", "8011"),
        ("--max-model-len", "65536"),
        ("--max-num-seqs", "2"),
        ("--gpu-memory-utilization", "0.85"),
        ("--scheduling-policy", "priority"),
    ]:
        assert argv[argv.index(flag) + 1] == value
    assert argv[argv.index("--tool-call-parser") + 1] == "hermes"
    assert argv[argv.index("--reasoning-parser") + 1] == "deepseek_r1"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[-1] == "--enforce-eager"  # extra args come last, untouched
    assert argv.count("--enforce-eager") == 1 and len(argv) == len(EXPECTED_DEFAULT_ARGV) + 3


def test_serve_hands_the_api_key_to_vllm_by_environment_only(fake_vllm):
    key = "sk-test-4f9c0d5e1a"
    result, recorded = fake_vllm({**MODEL_ENV, "VLLM_API_KEY": key})
    assert result.returncode == 0, result.stderr
    assert recorded["key"] == key
    assert not any(key in arg for arg in recorded["argv"]) and "--api-key" not in recorded["argv"]
    assert key not in result.stdout + result.stderr
    assert "api key: on" in result.stderr


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        ({"MASS_SERVE_NAME": "L1"}, (), "MASS_SERVE_MODEL"),
        ({"MASS_SERVE_MODEL": "/models/x"}, (), "MASS_SERVE_NAME"),
        ({**MODEL_ENV, "MASS_SERVE_PORT": "80a"}, (), "MASS_SERVE_PORT=80a"),
        ({**MODEL_ENV, "MASS_SERVE_PORT": "70000"}, (), "MASS_SERVE_PORT=70000"),
        ({**MODEL_ENV, "MASS_SERVE_GPU_MEMORY_UTILIZATION": "1.5"}, (), "MASS_SERVE_GPU_MEMORY_UTILIZATION"),
        ({**MODEL_ENV, "MASS_SERVE_MAX_NUM_SEQS": "0"}, (), "MASS_SERVE_MAX_NUM_SEQS"),
        ({**MODEL_ENV, "MASS_SERVE_SCHEDULING_POLICY": "lifo"}, (), "MASS_SERVE_SCHEDULING_POLICY=lifo"),
        ({**MODEL_ENV, "VLLM_API_KEY": "two words"}, (), "VLLM_API_KEY contains whitespace"),
        (MODEL_ENV, ("--api-key", "abc"), "never as --api-key"),
        (MODEL_ENV, ("--api-key=abc",), "never as --api-key"),
    ],
)
def test_serve_refuses_bad_input_with_one_clear_line(fake_vllm, env, args, message):
    result, recorded = fake_vllm(env, *args)
    assert result.returncode == 64
    assert recorded is None, "vllm must not start on bad input"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
    assert "two words" not in result.stderr and "abc" not in result.stderr


def test_serve_script_is_shellcheck_clean():
    result = subprocess.run(
        [str(BIN / "shellcheck"), "--severity=style", str(SERVE_SH)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr

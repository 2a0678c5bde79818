"""The agent process's environment: an allow-list, nothing inherited but PATH, and never the API key.

`agent_environment` builds it (thread limits, CUDA visibility, stream timeouts, the per-attempt proxy token in
`AGENT_TOKEN_ENV`, the scope marker `SCOPE_ENV` that `agent_process.kill_scope` finds leftovers by, the containment
in `SANDBOX_ENV`); `environment_policy` is its human-readable record in the status document, never a credential.
"""

from __future__ import annotations

from collections.abc import Mapping

from mass_ops.compute.sandbox import BWRAP_DESCRIPTION, egress_url_in_sandbox
from mass_ops.config import CycleConfig
from mass_ops.runtime.attempt_folder import AttemptPaths
from mass_ops.runtime.preflight import EpisodePreflightError
from mass_ops.runtime.settings import AGENT_TOKEN_ENV

SCOPE_ENV = "MASS_EPISODE_SCOPE"
# Tells the agent how it is contained ("bwrap", "pod" or "none"), as Codex CLI's CODEX_SANDBOX does.
SANDBOX_ENV = "MASS_EPISODE_SANDBOX"
THREAD_LIMIT_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")
OPENMM_THREADS_VAR = "OPENMM_CPU_THREADS"
LOCAL_HOSTS = "127.0.0.1,localhost"


def agent_environment(
    config: CycleConfig,
    paths: AttemptPaths,
    *,
    agent_token: str,
    scope: str,
    path_value: str,
    sandbox: str = "none",
) -> dict[str, str]:
    """The complete environment of the agent process: an allow-list, nothing inherited but PATH.

    Thread limits and CUDA visibility follow the reference. The agent's only credential is its episode proxy token
    in `AGENT_TOKEN_ENV` (the variable settings.json's `envKey` names); the variable `inference.api_key_env` names
    is never set, so neither the key nor its name's value reaches the agent (never argv, never a file). `sandbox`
    (`EpisodeRunner.agent_sandbox`) goes to `SANDBOX_ENV`; in the bwrap sandbox the attempt's tmp folder is `/tmp`,
    and with `runtime.sandbox_egress: public` every proxy variable names the attempt's egress proxy (downloads), while
    `NO_PROXY` keeps the episode proxy on 127.0.0.1 direct.
    """
    runtime = config.runtime
    threads = str(runtime.thread_limit)
    env = {
        "PATH": path_value,
        "HOME": str(paths.home),
        "QWEN_HOME": str(paths.qwen_home),
        "TMPDIR": "/tmp" if sandbox == "bwrap" else str(paths.tmp),
        "LANG": "C.UTF-8",
        **dict.fromkeys(THREAD_LIMIT_VARS, threads),
        OPENMM_THREADS_VAR: threads,
        "LOKY_MAX_CPU_COUNT": str(2 * runtime.thread_limit),  # the reference pairs 2 threads with 4 loky workers
        "CUDA_VISIBLE_DEVICES": runtime.episode_cuda_visible_devices,
        "QWEN_STREAM_IDLE_TIMEOUT_MS": str(runtime.stream_idle_timeout_ms),
        # qwen-code 0.21 also caps a stream's whole lifetime (15 min by default); the per-response timeout is the
        # limit the reference sets for a response, so the lifetime cap must not cut a long generation earlier.
        "QWEN_STREAM_MAX_LIFETIME_MS": str(runtime.http_response_timeout_ms),
        "QWEN_TELEMETRY_ENABLED": "false",
        "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",
        "NO_PROXY": LOCAL_HOSTS,
        "no_proxy": LOCAL_HOSTS,
        SCOPE_ENV: scope,
        SANDBOX_ENV: sandbox,
        AGENT_TOKEN_ENV: agent_token,
    }
    if sandbox == "bwrap" and runtime.sandbox_egress == "public":
        egress = egress_url_in_sandbox()
        env |= dict.fromkeys(("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY"), egress)
    key_name = config.inference.api_key_env
    if key_name in env:
        raise EpisodePreflightError(
            f"episode preflight: inference.api_key_env {key_name!r} collides with a variable the runtime sets"
        )
    return env


def environment_policy(env: Mapping[str, str], key_name: str) -> str:
    """Human-readable record of the agent environment: variable names, limits, never a credential."""
    shown = {name: value for name, value in env.items() if name not in (AGENT_TOKEN_ENV, "PATH", SCOPE_ENV)}
    settings = ", ".join(f"{name}={value}" for name, value in sorted(shown.items()))
    containment = {
        "bwrap": BWRAP_DESCRIPTION,
        "pod": "the episode pod's sandbox container",
    }.get(env.get(SANDBOX_ENV, "none"), "no sandbox: a process of the runner's user on the host network")
    return (
        f"{containment}; allow-listed environment; PATH inherited; no API key ({key_name} is held by the logging "
        f"proxy); per-episode proxy token in {AGENT_TOKEN_ENV} (value not recorded); {settings}"
    )

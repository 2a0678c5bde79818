"""`mass_ops.runtime.runner` keeps every name it defined before its split, each the one object of its own module."""

from __future__ import annotations

import importlib

from mass_ops.runtime import runner

# Where each step of an attempt lives now (docs/runtime.md); runner re-exports these names for existing importers.
HOMES = {
    "preflight": ("EpisodePreflightError", "EndpointUnreachableError", "ModelNotListedError", "check_endpoint",
                  "resolve_api_key", "discovery_model_id", "PREFLIGHT_TIMEOUT_S", "MODEL_LIST_MAX_BYTES"),
    "attempt_folder": ("AttemptPaths", "EpisodeBusyError"),
    "workspace_seed": ("WorkspaceSeedError", "fetch_workspace_seed", "extract_workspace_seed"),
    "agent_environment": ("agent_environment", "environment_policy", "SCOPE_ENV", "SANDBOX_ENV", "LOCAL_HOSTS",
                          "THREAD_LIMIT_VARS", "OPENMM_THREADS_VAR"),
    "agent_process": ("AgentRun", "kill_scope"),
    "attempt_session": ("AttemptSession", "ProxySessions"),
    "redaction": ("SecretRedactor",),
    "publication": ("EpisodeRecord", "AttemptFiles", "EpisodePublication"),
    "publishing": ("PublicationSink", "StoreSink", "PublishAborted", "PUBLISH_ORDER", "publish_episode",
                   "publish_artifacts", "record_publication"),
}  # fmt: skip


def test_every_moved_name_is_re_exported_as_the_same_object() -> None:
    for module_name, names in HOMES.items():
        module = importlib.import_module(f"mass_ops.runtime.{module_name}")
        for name in names:
            assert getattr(runner, name) is getattr(module, name), f"runner.{name} is not {module_name}.{name}"
            assert name in runner.__all__


def test_the_hand_off_s_proxy_log_reader_is_the_publication_s() -> None:
    from mass_ops.runtime.publication import read_proxy_log

    # The runner reads the log through this module-level name at each attempt, so a test can replace it there.
    assert runner._read_proxy_log is read_proxy_log
    assert sorted(runner.__all__) == sorted(set(runner.__all__))
    assert all(hasattr(runner, name) for name in runner.__all__)

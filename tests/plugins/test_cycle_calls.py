"""Stage calls from tasks: lazy import by name, credentials exported for the call, XCom kept to ids and URIs."""

from __future__ import annotations

import json
import os

import pytest
from mass_ops_airflow.cycle import XCOM_LIMIT_BYTES, StageResultError, run_stage, stage_function, xcom_safe
from mass_ops_airflow.pools import GPU_POOL, INFERENCE_POOL, default_pools, pools_import_document


def test_run_stage_passes_the_config_and_arguments(stages):
    stages.results["collect_candidate"] = lambda config, task, candidate: {"cycle": config.cycle_name, "c": candidate}
    assert run_stage("collect_candidate", {"preset": "demo"}, 51, 2) == {"cycle": "demo-L0", "c": 2}
    assert stages.calls[0][1][1:] == (51, 2)


def test_missing_stage_is_named(stages, monkeypatch):
    monkeypatch.setattr(type(stages), "__getattr__", lambda self, name: (_ for _ in ()).throw(AttributeError(name)))
    with pytest.raises(AttributeError, match=r"nor mass_ops\.ops\.api has a stage function .warp."):
        stage_function("warp")


def test_artifact_credentials_are_exported_only_during_the_call(stages, monkeypatch):
    monkeypatch.setenv(
        "AIRFLOW_CONN_MASS_ARTIFACTS",
        json.dumps(
            {
                "conn_type": "aws",
                "login": "AKIA1",
                "password": "pw-secret",
                "extra": {"artifact_url": "s3://lab-bucket/p"},
            }
        ),
    )
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    seen = {}
    stages.results["render"] = lambda config: (
        seen.update(key=os.environ.get("AWS_ACCESS_KEY_ID"), url=config.storage.artifact_url) or {"ok": True}
    )
    assert run_stage("render", {"preset": "demo"}) == {"ok": True}
    assert seen == {"key": "AKIA1", "url": "s3://lab-bucket/p"}
    assert "AWS_ACCESS_KEY_ID" not in os.environ


def test_xcom_carries_small_json_only():
    assert xcom_safe("s", {"uri": "s3://b/k", "ids": [1, 2]}) == {"uri": "s3://b/k", "ids": [1, 2]}
    with pytest.raises(StageResultError, match="stage s returned a value that is not JSON"):
        xcom_safe("s", {"x": object()})
    with pytest.raises(StageResultError, match="XCom carries ids and URIs only"):
        xcom_safe("s", {"blob": "x" * (XCOM_LIMIT_BYTES + 1)})


def test_pools_document_for_airflow_pools_import():
    document = json.loads(pools_import_document(default_pools(inference_slots=8)))
    assert document[INFERENCE_POOL] == {
        "slots": 8,
        "description": "Episodes and judge calls in flight against the model server",
        "include_deferred": True,
    }
    assert document[GPU_POOL]["include_deferred"] is True, "a deferred GPU job still holds its GPUs"

"""The Airflow pools that bound a cycle's concurrency, and how to create them.

- `mass_inference`: requests in flight against the model server (episodes and judge/optimizer calls). Its size is
  the server's capacity (`inference.max_concurrent_requests`, vLLM's `--max-num-seqs`).
- `mass_gpu`: GPU jobs (training, export, the inference servers' setup). Created with `include_deferred`, because a
  deferred training task still holds its GPUs while the triggerer waits for it.

Both count deferred tasks: an episode pod waited on by the triggerer still occupies a server slot.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

INFERENCE_POOL = "mass_inference"
GPU_POOL = "mass_gpu"


@dataclass(frozen=True)
class PoolSpec:
    """One pool as `airflow pools import` reads it."""

    name: str
    slots: int
    description: str
    include_deferred: bool = True


def default_pools(*, inference_slots: int = 4, gpu_slots: int = 1) -> list[PoolSpec]:
    """The pools a deployment needs; slots default to the paper's one vLLM with `--max-num-seqs 4`, one GPU job."""
    return [
        PoolSpec(INFERENCE_POOL, inference_slots, "Episodes and judge calls in flight against the model server"),
        PoolSpec(GPU_POOL, gpu_slots, "GPU jobs: inference servers, training, export"),
    ]


def pools_import_document(pools: list[PoolSpec]) -> str:
    """JSON for `airflow pools import FILE` (name → slots, description, include_deferred)."""
    payload = {p.name: {k: v for k, v in asdict(p).items() if k != "name"} for p in pools}
    return json.dumps(payload, indent=2, sort_keys=True)


if __name__ == "__main__":  # python -m mass_ops_airflow.pools > pools.json && airflow pools import pools.json
    print(pools_import_document(default_pools()))

"""The stage layer: one function per stage of a cycle, shared by the CLI, the Airflow DAG tasks and Python callers.

`api` holds the stage functions by name: each takes the validated `CycleConfig` first (each process or pod rebuilds
it from the same preset and overrides), attaches the cycle once, calls its family module with that context, and
returns a small JSON-able dict of ids and URIs — never big data, so it can travel through XCom. The families live
beside it, one module each: `plan` (plan, validate), `search`, `collect`, `rank` (rank, select), `render`, `train`
(train, select checkpoint), `export`, `register`, `evaluate` (rollouts, judging, report), `nightly`, and `units`
(the episode a stage runs for one unit, for episode pods); `common` holds what they share. Domain packages
(`search/`, `judge/`, `render/`, `train/`, `export/`, `evaluation/`) hold the algorithms and never import this layer.

Stages are idempotent: a rerun skips finished units (episodes, judge calls, proposals, rows), which is what makes an
Airflow retry, a cleared task instance or a backfill redo only what is missing.
"""

"""Where a command runs: local processes (embedded default) or Kubernetes workloads (production).

`mass_ops.compute.kubernetes` builds the manifests of the pods, Jobs, Deployments and Services a cycle starts, as
plain dicts (no Kubernetes client, no Airflow); `mass_ops.compute.local` starts and stops a local model server and
runs commands as local processes; `mass_ops.compute.readiness` decides when an OpenAI-compatible server is ready.
`mass_ops.compute.backend` is the one choice between them (`backend_for(config)`); `processes` supervises process
groups and `limits` holds the endpoint's concurrency limit. Overview: docs/compute.md.
"""

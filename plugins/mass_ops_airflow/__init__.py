"""Airflow side of mass-ops: operators, triggers and hooks that run MASS cycles on Kubernetes or locally.

Modules import nothing heavy at the top (no Kubernetes client, no provider operators, no mass_ops.stages), so DAG
files that use them parse fast; the heavy parts load inside `execute`.
"""

__version__ = "0.1.0"

# The DAG ids, written once: the DAG files, the demo's driver and its UI use these.
CYCLE_DAG_ID = "mass_cycle"
NIGHTLY_DAG_ID = "mass_nightly_eval"

"""mass-ops: MASS recursive self-improvement cycles as a production pipeline.

The package never imports Airflow; `dags/` and `plugins/mass_ops_airflow` call into `mass_ops.stages`.
"""

__version__ = "0.1.0"

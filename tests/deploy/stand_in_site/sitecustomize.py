"""Test-only interpreter hook: this folder is on PYTHONPATH only in the processes of the demo UI started by
`tests/deploy/demo_ui_process.py`, where every local model server becomes the scripted policy stand-in.

It must not fail silently (Python only warns about a broken sitecustomize), so a failure is printed on stderr,
which ends up in the UI's log and the task logs.
"""

import sys

try:
    # This hook shadows the demo UI's own (only one sitecustomize is imported): do what that one does too.
    from mass_ops_airflow.demo.loopback import install

    install()
    from tests.deploy.stand_in_serving import use_policy_stand_in

    use_policy_stand_in()
except Exception as exc:  # pragma: no cover - reported, never expected
    print(f"stand_in_site: cannot install the policy stand-in: {type(exc).__name__}: {exc}", file=sys.stderr)
    raise

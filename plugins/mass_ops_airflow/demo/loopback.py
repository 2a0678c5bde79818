"""Keep the demo UI's Airflow log servers on 127.0.0.1.

The scheduler and the triggerer of `airflow standalone` each start a log server (uvicorn) on every interface, and
Airflow 3.3 has no setting for its address; on a laptop that exposes task logs to the local network. `install`
wraps `uvicorn.run` so that Airflow's log-server app binds to the loopback address instead. The demo UI puts
`site/` (whose `sitecustomize` calls `install`) first on the PYTHONPATH of `airflow standalone`, so every Airflow
process it starts, and the log-server processes they fork or spawn, get it.
"""

from __future__ import annotations

from typing import Any

LOG_SERVER_APP = "airflow.utils.serve_logs.log_server:get_app"
LOOPBACK = "127.0.0.1"
_ALL_INTERFACES = {"", "0.0.0.0", "::", None}


def install() -> None:
    """Make `uvicorn.run` bind Airflow's log-server app to 127.0.0.1 (idempotent; other apps are untouched)."""
    import uvicorn

    if getattr(uvicorn.run, "_mass_ops_loopback", False):
        return
    original = uvicorn.run

    def run(app: Any, *args: Any, **kwargs: Any) -> Any:
        if app == LOG_SERVER_APP and kwargs.get("host") in _ALL_INTERFACES:
            kwargs["host"] = LOOPBACK
        return original(app, *args, **kwargs)

    run._mass_ops_loopback = True  # type: ignore[attr-defined]
    uvicorn.run = run

"""Cycle operations, apart from the stage families: the plan and its estimate (`plan`), where a cycle stands
(`status`), redoing what is missing (`repair`), the leases that mark an episode pod as running (`leases`), and the
functions the DAG and the CLI call for them (`api`). This package stands on the stage layer, never the reverse."""

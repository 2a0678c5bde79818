"""What a cycle will cost and what it has cost: the price table's arithmetic (`prices`), the pre-run estimate from
planned counts and per-unit token figures (`estimate`), those figures measured on a finished cycle (`lineage`), and
`records.StageUsage`, the one per-stage record of tokens, cost, GPU-hours and wall-clock that the estimate, the
report and the status share.

Pure functions over counts and records; the stage layer (`ops.plan`, `ops.status`) feeds them."""

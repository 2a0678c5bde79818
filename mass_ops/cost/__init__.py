"""What a cycle will cost and what it has cost: the price table's arithmetic (`prices`), the pre-run estimate from
planned counts and per-unit token figures (`estimate`), and those figures measured on a finished cycle (`lineage`).

Pure functions over counts and records; the stage layer (`ops.plan`, `ops.status`) feeds them."""

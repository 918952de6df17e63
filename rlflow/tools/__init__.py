"""What users run: the `rlflow` command, the live table, the report and the
planner."""

"""Tasks: where prompts come from and how answers are scored, built from the
run's config.

* `core`: the `Task` protocol, the simulated and arithmetic tasks and
  `make_task`, which builds the task a config names;
* `arith`: the default task's rules (numpy only: a peer process without
  the rest of rlflow imports it alone);
* `dataset`: the user's own files and reasoning-gym's problems as a task.

Importing this package imports nothing: `rlflow.tasks.arith` stays as light
as its own imports.
"""

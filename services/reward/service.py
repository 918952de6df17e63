"""The reward service: scores every response of a batch and passes it on.

Scoring is per sample and concurrent (up to the engine's `concurrency`
samples per replica; a simulated score that takes no time is computed in
place, without a task of its own). Three engines: the simulated one, the task's own
verifier (`task`, e.g. the arithmetic default's answer check, in worker
threads), and reward functions named by import path (`functions`, in
worker processes that are killed when a call overruns; see
`rlflow.rewards`).

No silent zeros. A sample whose scoring fails keeps its row, gets NaN as
its reward and an entry in the batch's `failures` naming the function and
why (timeout, error, crashed). With reward functions the config says what
then happens to its group (`on_failure`): by default the group is dropped
for good, and the controller told so (`Dropped`); or the call is retried;
or the function's value is an explicit fallback. Failures are counted per
function and reason in the heartbeats.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlflow.config import FunctionsReward
from rlflow.protocol import Dropped, SampleBatch, SampleFailure, take
from rlflow.rewards import Sample
from rlflow.services.base import Control, StageService
from rlflow.services.reward.scorer import Scorer


class RewardService(StageService):
    """Fills in `rewards` and `reward_details` (or passes on batches the
    rollout scored in line, `roles.reward.inline`)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.engine = spec.config.roles.reward.engine
        self.task = self.load_task()
        env = spec.config.roles.env
        # The episodes' own rewards: the environment's (weighted), or those outside agents gave.
        weight = env.reward_weight if env is not None else 1.0 if spec.config.agents is not None else None
        self.scorer = Scorer(self.engine, self.task, self.counters, (spec.config.run.seed, spec.rank, 11),
                             env_weight=weight)
        # Enough whole batches in flight to keep `concurrency` samples busy
        # while a batch waits for its slowest sample (a long tail of latency).
        self.max_batches = 2 * max(1, self.engine.concurrency // spec.config.run.samples_per_prompt) + 1
        self.reference_problems: list[str] = []

    @property
    def pool(self):
        return self.scorer.pool

    @pool.setter
    def pool(self, pool) -> None:
        self.scorer.pool = pool

    async def main(self, control: Control) -> None:
        if not isinstance(self.engine, FunctionsReward):
            await super().main(control)
            return
        from rlflow.rewards import open_pool

        async with open_pool(self.engine.functions, start_timeout_s=self.engine.start_timeout_s,
                             import_dir=self.config.run.import_dir) as pool:
            self.pool = pool
            self.reference_problems = await check_references(pool, self.task, self.engine.check_references)
            for problem in self.reference_problems:
                self.log.warning("[%s] %s", self.spec.name, problem)
            await super().main(control)

    def hello_fields(self) -> dict[str, Any]:
        return {"problems": list(self.reference_problems)}

    async def process(self, batch: SampleBatch) -> SampleBatch | None:
        if self.config.roles.reward.inline:
            return batch  # scored by the rollout already
        scored, failures = await self.scorer.score(batch)
        if failures and isinstance(self.engine, FunctionsReward):
            return await self._drop_failed_groups(scored, failures)
        return scored

    async def _drop_failed_groups(self, batch: SampleBatch, failures: list[SampleFailure]) -> SampleBatch | None:
        """Drop, for good, each group with a sample its functions could not
        score (its other samples would give a biased group baseline), and
        tell the controller; the batch of the other groups, if any."""
        group_of = np.repeat(np.arange(len(batch.groups)), [g.size for g in batch.groups])
        failed = {int(group_of[f.index]) for f in failures}
        by_reason: dict[str, list[int]] = {}
        for f in failures:
            gid = batch.groups[int(group_of[f.index])].group_id
            if gid not in by_reason.setdefault(f"reward {f.kind}", []):
                by_reason[f"reward {f.kind}"].append(gid)
        for reason, ids in by_reason.items():
            await self.control.send(Dropped(group_ids=ids, reason=reason))
        self.counters["dropped_groups"] += len(failed)
        keep = [row for row, g in enumerate(group_of) if int(g) not in failed]
        return take(batch, keep) if keep else None


async def check_references(pool: Any, task: Any, rows: int) -> list[str]:
    """Score the reference answers of the task's first `rows` rows that have
    one, as if they were responses; the problems found."""
    from rlflow.rewards import check_references as check

    found = []
    for group_id in range(rows):  # the first rows of the run
        reference = task.prompt(group_id, 1).reference
        if reference:
            found.append(Sample(prompt=task.prompt_text(group_id), response=reference, reference=reference,
                                row=dict(task.row(group_id))))
    return await check(pool, found) if found else []

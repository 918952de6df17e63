"""The run's algorithmic shape (`[run]`: mode and staleness, batch, steps) and its
task (`[task]`: the prompts and how answers are checked)."""

from __future__ import annotations

from typing import Literal, Union

import msgspec

from rlflow.config.base import Fraction, NonNegInt, PosInt, Table

#: The staleness bound each mode implies where `run.max_staleness` is left out; sync and one_step
#: allow no other (the one place this rule is written: `RunConfig.max_staleness` and `checks` read it).
IMPLIED_STALENESS = {"sync": 0, "one_step": 1, "async": 2}


class RunConfig(Table, frozen=True):
    """The algorithmic shape of the run."""

    mode: Literal["sync", "one_step", "async"] = "async"
    """sync: no staleness and a barrier per step; one_step: one step behind; async: up to max_staleness.
    The mode implies its staleness: `--set run.mode=...` that changes the file's mode also drops the
    file's max_staleness (the bound of the other mode), unless max_staleness is set too."""
    # The key as the file gives it; code reads the bound in force, the property `max_staleness`.
    max_staleness_given: NonNegInt | None = msgspec.field(default=None, name="max_staleness")
    """Versions a token may lag the trainer (default, or left out: 0 sync, 1 one_step, 2 async). With
    sync or one_step it may only restate that value: set with the mode to something else, it is an error."""
    batch_size: PosInt = 8
    """Prompt groups per optimizer step."""
    samples_per_prompt: PosInt = 8
    """Responses per prompt (the group size)."""
    steps: PosInt = 20
    """Optimizer steps to run."""
    seed: int = 0
    """Seed of prompts, simulated engines and training."""
    deterministic: bool = False
    """With mode = "sync": two runs with the same seed and config on one machine write the same
    metrics.jsonl and evals.jsonl, row for row, but for what measures time and load (`StepRow.learning`,
    `EvalRow.learning`). Each request samples from a seed of its own (the run's seed and its prompt
    group), the trainer takes each step's groups in the order of their ids, with deterministic
    kernels, and no group is generated while a held-out evaluation runs (a batch that mixes an
    evaluation's prompts with training's turns may round otherwise). It holds because vLLM on a CPU
    computes a sequence alike whatever else in its batch decodes (measured: bit-equal log-probabilities
    alone and among seven others, float32 and bfloat16); on a GPU it is not measured. An asynchronous
    run cannot promise it: which version generated a token depends on when the weights arrived. Not
    with outside agents or an environment (their turns' order is theirs)."""
    run_dir: str = "runs/{time}"
    """Where the run writes its config, metrics and checkpoints ({time} is the start time)."""
    resume: str = ""
    """A checkpoint directory to continue from (set by `rlflow up --resume`)."""
    import_dir: str = ""
    """Where the user's own modules are imported from (reward functions named by import path, such as
    "my_rewards:brevity"): put first on the import path of every service and reward worker, whatever
    its working directory. Empty: the directory `rlflow` is run from. The launcher makes it absolute;
    a run that spans nodes needs it at the same path on each (a shared filesystem)."""
    partial_rollout: bool = True
    """Keep generating across weight updates (tokens after an update carry the new version);
    false: finish in-flight requests on the old weights before applying an update."""
    max_grants: PosInt = 3
    """A prompt group whose grant fails this many times (every sample failed, or the rollout replica
    generating it died) is dropped for good with reason `poison`, named in the log, the ledger and the
    audit; the run goes on. The last try is alone: to a rollout replica holding no other group, which
    takes no other meanwhile (a group lost with the crowd is trained then). A replica's death after the
    group was generated is not its failure."""
    filter: Literal["none", "signal"] = "none"
    """signal: train only on groups with signal (rewards not all equal: a group-relative advantage
    is 0 for every sample of the others). The trainer drops the others (reason `no_signal` in the
    ledger and the audit) and the controller grants other prompts in their place, ahead of need by
    the share of recent groups without signal, within the staleness bound; every step still trains
    on batch_size groups. none: train on every group (the trainer leaves out the no-signal ones'
    loss, `skip_uniform_groups`, but they fill a slot of the batch)."""
    credits: Literal["bound", "paced"] = "bound"
    """bound: the rollout is granted groups for max_staleness steps ahead of the trainer, always.
    paced: only as far ahead as keeps the trainer fed (between 1 and max_staleness steps: one less after
    three steps in which the trainer did not wait for groups, one more after a step in which it did),
    so that samples are no staler than the throughput needs; max_staleness stays the ceiling."""
    staleness_check: Literal["admission", "strict"] = "admission"
    """admission: every group starts on weights at most max_staleness versions behind the
    step it is granted for (the credits); a long response that keeps generating across
    updates may reach the trainer older than that (staleness_max reports by how much) and
    nothing generated is thrown away. strict: no token lagging the trainer by more than
    max_staleness versions is trained on; groups that pass the bound are generated again."""

    @property
    def max_staleness(self) -> int:
        """The staleness bound in force: the key `max_staleness`, or the mode's (`IMPLIED_STALENESS`)."""
        given = self.max_staleness_given
        return given if given is not None else IMPLIED_STALENESS[self.mode]


class ArithTask(Table, tag_field="kind", tag="arith", frozen=True):
    """Addition written out column by column; reward 1 for the right sum.
    More digits need longer answers, so response lengths are long-tailed."""

    digit_weights: tuple[float, ...] = (0.06, 0.24, 0.2, 0.15, 0.12, 0.1, 0.08, 0.05)
    """Relative frequency of problems whose first operand has 1, 2, ... digits
    (one-digit problems are few: there are only 100, and the held-out set takes them)."""
    heldout_size: PosInt = 1000
    """Problems in the held-out set (never used for training)."""
    heldout_seed: int = 1234
    """Seed of the held-out set (fixed, so that runs compare)."""


class SimTask(Table, tag_field="kind", tag="sim", frozen=True):
    """Random token prompts; the simulated reward scores answers at random."""

    prompt_len: PosInt = 32
    """Prompt length in tokens."""
    vocab_size: PosInt = 32000
    """Token ids are drawn below this."""
    reward_p: Fraction = 0.5
    """Chance that a simulated answer is right."""


class DatasetTask(Table, tag_field="kind", tag="dataset", frozen=True):
    """Prompts from the user's own files, read with the `datasets` library (JSON
    lines, JSON, Parquet, CSV, or a folder written by `save_to_disk`); nothing is
    downloaded. Scored by the reward role's functions (`roles.reward.engine.kind =
    "functions"`), which get each row."""

    train: str
    """File or folder of the training prompts."""
    eval: str = ""
    """File or folder of the evaluation prompts (never trained on); empty: `eval_fraction` of `train`."""
    eval_fraction: Fraction = 0.0
    """Share of the training rows held out for evaluation when `eval` is empty (never trained on)."""
    eval_size: NonNegInt = 0
    """Evaluate at most this many rows (0: all of the evaluation split)."""
    prompt: str = "prompt"
    """Column of the prompt: a string, or a list of chat messages ({role, content} tables)."""
    answer: str = "answer"
    """Column of the reference answer the reward functions check against (empty: none)."""
    chat_template: bool = True
    """Render prompts with the tokenizer's chat template (and the generation prompt), where it has one;
    false: plain-text prompts are tokenized as they are."""
    system_prompt: str = ""
    """A system message put before each prompt rendered with the chat template."""
    max_prompt_tokens: PosInt = 1024
    """Rows whose rendered prompt is longer are left out when the data is loaded (and counted)."""


class ReasoningGymTask(Table, tag_field="kind", tag="reasoning_gym", frozen=True):
    """Procedural problems of the `reasoning-gym` package, generated locally
    (the optional extra `rlflow[tasks]`); score them with the reward function
    `rlflow.rewards:reasoning_gym`, which asks the dataset's own verifier."""

    dataset: str
    """The reasoning-gym dataset, e.g. "leg_counting" or "basic_arithmetic"."""
    size: PosInt = 10000
    """Problems to generate for training (group ids cycle over them, reshuffled each epoch)."""
    eval_size: NonNegInt = 1000
    """Problems generated for evaluation, from `eval_seed` (never trained on: a training problem that is
    also one of them is left out). A reading of 1,000 has a standard error near 1.4 points at 30%
    accuracy (near 3 with 200: too coarse to see RL's first points of progress)."""
    eval_seed: int = 1234
    """Seed of the evaluation problems: fixed, whatever `run.seed`, so that runs of different seeds are
    evaluated on the same problems (the training problems are drawn from `run.seed`)."""
    options: dict[str, Union[int, float, str, bool]] = {}
    """The dataset's own settings (passed to `reasoning_gym.create_dataset`)."""
    chat_template: bool = True
    """Render prompts with the tokenizer's chat template (and the generation prompt), where it has one."""
    system_prompt: str = ""
    """A system message put before each prompt rendered with the chat template."""
    max_prompt_tokens: PosInt = 1024
    """Problems whose rendered prompt is longer are left out (and counted)."""


TaskConfig = Union[SimTask, ArithTask, DatasetTask, ReasoningGymTask]

"""The peer of `bench/peer.py`: Hugging Face TRL's GRPOTrainer on rlflow's task.

Runs in the peer's own virtual environment (`make peer`: TRL, transformers
and the CPU build of torch, nothing of vLLM or rlflow's dependencies), from a
plan that `bench/peer.py` writes: the model directory, the prompts of every
step in rlflow's order (the task stream of the run's seed), and rlflow's
batch, sampling, optimizer, schedule and loss. Answers are scored by
rlflow's own rule (`rlflow.tasks.arith`, which needs nothing but numpy).

TRL runs as its users run it: its own generation (transformers `generate`,
fully on-policy), its own loss (`loss_type = "dapo"`: the clipped surrogate
summed over tokens and divided by every completion token of the batch), its
own group advantages (rewards less the group's mean, over the group's
standard deviation). Where rlflow's settings are TRL's to take, it takes
them (see `settings`).

It evaluates nothing itself. It writes the policy's weights at marks, off
its clock: after every `every` steps, and at each mark of training time
the weights it held at that moment (those of the last step finished before
it). `bench/peer.py` evaluates every one of them with the same evaluator as
rlflow's checkpoints.

    .venv-peer/bin/python bench/peer_trl.py PLAN.json
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # rlflow.tasks.arith alone: it imports numpy and nothing of rlflow's

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from rlflow.tasks.arith import Arith  # noqa: E402


def learning_rate_factor(step: float, plan: dict) -> float:
    """rlflow's schedule (`learning_rate` of its torch trainer) as a factor of lr at step `step` (from 0)."""
    warmup, decay, final, total = plan["warmup_steps"], plan["lr_decay"], plan["lr_final"], plan["lr_decay_steps"]
    if warmup and step < warmup:
        return (step + 1) / warmup
    if decay == "none":
        return 1.0
    span = max(total - 1 - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    shape = 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return final + (1.0 - final) * shape


class Marks(TrainerCallback):
    """The training clock (callbacks' own time taken off it), the per-step log,
    the weights written at step and time marks, and the stop."""

    def __init__(self, plan: dict, out: pathlib.Path):
        self.plan, self.out = plan, out
        self.time_marks = sorted(plan["time_marks"])
        self.started = 0.0
        self.paused = 0.0
        self.previous: dict[str, torch.Tensor] | None = None  # the weights after the last step
        self.steps = open(out / "steps.jsonl", "w")
        self.marks = open(out / "marks.jsonl", "w")
        self.ended: dict[int, float] = {}  # step -> training clock when it ended

    def clock(self) -> float:
        return time.monotonic() - self.started - self.paused if self.started else 0.0

    def schedule_step(self, step: int) -> float:
        """Where in rlflow's schedule the peer is at its step `step`: that step, or with a schedule over
        its time budget (`schedule_s`), the share of the budget spent so far of the schedule's steps (the
        schedule spans the steps the peer makes in its budget, however many that is)."""
        if not self.plan["schedule_s"]:
            return step
        return self.clock() / self.plan["schedule_s"] * self.plan["lr_decay_steps"]

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.monotonic()

    def on_log(self, args, state, control, logs=None, **kwargs):
        step = state.global_step
        numbers = {k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))}
        self.steps.write(json.dumps({"step": step, "time_s": self.ended.get(step), **numbers}) + "\n")
        self.steps.flush()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        now = self.clock()
        paused_at = time.monotonic()
        step = state.global_step
        weights = {k: v.detach().to(torch.float32).clone().contiguous() for k, v in model.state_dict().items()}
        # The policy held at a time mark is the one after the last step that ended before it.
        while self.time_marks and self.time_marks[0] <= now:
            mark = self.time_marks.pop(0)
            self._save(f"time-{mark}", self.previous, step - 1, mark)
        if step % self.plan["every"] == 0:
            self._save(f"step-{step}", weights, step, now)
        self.previous = weights
        self.ended[step] = now
        if step >= self.plan["min_steps"] and now >= self.plan["min_time_s"]:
            control.should_training_stop = True
        self.paused += time.monotonic() - paused_at

    def _save(self, name: str, weights: dict | None, step: int, time_s: float) -> None:
        if weights is None:  # a time mark before the first step ended: the starting weights
            self.marks.write(json.dumps({"name": name, "step": 0, "time_s": time_s, "path": None}) + "\n")
            return
        folder = self.out / "checkpoints" / name
        folder.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(folder / "model.safetensors"))
        self.marks.write(json.dumps({"name": name, "step": step, "time_s": time_s, "path": str(folder)}) + "\n")
        self.marks.flush()


def settings(plan: dict, out: pathlib.Path) -> GRPOConfig:
    """TRL's configuration: rlflow's batch, sampling, optimizer and loss where
    TRL has them; TRL's own ways elsewhere."""
    return GRPOConfig(
        output_dir=str(out / "trl"),
        # One generation batch of batch_size x samples_per_prompt completions per optimizer step.
        per_device_train_batch_size=plan["batch_size"] * plan["samples_per_prompt"] // plan["accumulation"],
        gradient_accumulation_steps=plan["accumulation"],
        num_generations=plan["samples_per_prompt"],
        max_completion_length=plan["max_tokens"],
        temperature=plan["temperature"],
        top_p=plan["top_p"],
        top_k=0,
        beta=0.0,
        epsilon=plan["clip_low"],
        epsilon_high=plan["clip_high"],
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        learning_rate=plan["lr"],
        adam_beta1=plan["betas"][0],
        adam_beta2=plan["betas"][1],
        weight_decay=plan["weight_decay"],
        max_grad_norm=plan["grad_clip"],
        max_steps=plan["max_steps"],
        bf16=plan["bf16"],
        use_transformers_continuous_batching=plan["generation"] == "continuous",
        gradient_checkpointing=False,
        shuffle_dataset=False,
        seed=plan["seed"],
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def main() -> None:
    plan = json.loads(pathlib.Path(sys.argv[1]).read_text())
    out = pathlib.Path(plan["out"])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(plan["threads"])
    tokenizer = AutoTokenizer.from_pretrained(plan["model"])
    ids = tokenizer(plan["prompts"][:8])["input_ids"]
    if ids != plan["prompt_ids"][:8]:
        raise SystemExit(f"TRL's tokens of the first prompts differ from rlflow's: {ids[:2]} against "
                         f"{plan['prompt_ids'][:2]}")
    model = AutoModelForCausalLM.from_pretrained(plan["model"], dtype=torch.float32)
    config = settings(plan, out)
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan["lr"], betas=tuple(plan["betas"]),
                                  weight_decay=plan["weight_decay"], eps=1e-8)
    marks = Marks(plan, out)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: learning_rate_factor(marks.schedule_step(step), plan))

    @functools.cache
    def score_fn(source: str):
        import reasoning_gym

        return reasoning_gym.get_score_answer_fn(source)

    def correct(completions, answer, row, **kwargs):
        if plan["task"] == "default":
            return [Arith.check(a, c)[0] for c, a in zip(completions, answer, strict=True)]
        # A reasoning-gym dataset: its own verifier, as rlflow's `rlflow.rewards:reasoning_gym` asks it.
        rows = [json.loads(r) for r in row]
        return [float(score_fn(r["metadata"]["source_dataset"])(c, r))
                for c, r in zip(completions, rows, strict=True)]

    dataset = Dataset.from_dict({"prompt": plan["prompts"], "answer": plan["answers"], "row": plan["rows"]})
    trainer = GRPOTrainer(model=model, reward_funcs=correct, args=config, train_dataset=dataset,
                          processing_class=tokenizer, optimizers=(optimizer, schedule), callbacks=[marks])
    started = time.monotonic()
    trainer.train()
    (out / "done.json").write_text(json.dumps({"wall_s": time.monotonic() - started, "train_s": marks.clock(),
                                               "steps": trainer.state.global_step}))


if __name__ == "__main__":
    main()

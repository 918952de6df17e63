"""The typed config: shipped configs validate, bad input gets one clear line."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from rlflow import config as C

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHIPPED = sorted([*ROOT.glob("examples/*.toml"), *ROOT.glob("rlflow/defaults/*.toml")])

BASE = """
[pools.gen]
cpus_per_bundle = 1
[pools.train]
cpus_per_bundle = 0.5
[roles.rollout]
pool = "gen"
[roles.reward]
pool = "gen"
[roles.trainer]
pool = "train"
"""


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    config = C.load(path)
    assert config.run.steps >= 1
    # The resolved form (written into each run directory) loads back the same.
    assert C.load(text=C.to_toml(config)) == config


#: BASE as the tables `C.build` takes.
TABLES = {
    "pools": {"gen": {"cpus_per_bundle": 1}, "train": {"cpus_per_bundle": 0.5}},
    "roles": {"rollout": {"pool": "gen"}, "reward": {"pool": "gen"}, "trainer": {"pool": "train"}},
}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_a_config_built_from_a_files_tables_is_the_files(path):
    assert C.build(C.read_toml(path)) == C.load(path)
    sets = ["run.steps=3", "run.mode=sync"]  # the mode's implied staleness as from the file
    assert C.build(C.read_toml(path), overrides=sets) == C.load(path, sets)


def test_build_merges_tables_left_to_right_then_applies_the_overrides():
    assert C.build(TABLES) == C.load(text=BASE)
    first = {"a": {"b": 1, "c": {"d": 2}}, "xs": [1, 2], "t": {"u": 1}, "keep": "k"}
    second = {"a": {"c": {"e": 3}, "b": 4}, "xs": [3], "t": 5}
    drop = {"a": {"c": None}, "gone": None}
    assert C.merged(first, second, drop) == {"a": {"b": 4}, "xs": [3], "t": 5, "keep": "k"}
    assert C.merged(first, {"keep": {"now": "a table"}})["keep"] == {"now": "a table"}
    assert first == {"a": {"b": 1, "c": {"d": 2}}, "xs": [1, 2], "t": {"u": 1}, "keep": "k"}  # not changed
    sim = ROOT / "examples" / "sim.toml"
    # None drops a role (and here its pool): the config has none.
    assert C.load(sim).roles.teacher is not None
    no_teacher = C.build(C.read_toml(sim), {"roles": {"teacher": None}}, overrides=["roles.rollout.replicas=2"])
    assert no_teacher.roles.teacher is None and no_teacher.roles.rollout.replicas == 2
    # The overrides come after every table; the tables given are left as they were.
    config = C.build(TABLES, {"run": {"steps": 5, "batch_size": 2}}, overrides=["run.steps=3"])
    assert (config.run.steps, config.run.batch_size) == (3, 2)
    assert "run" not in TABLES and C.build(TABLES).run.steps == 20
    assert C.build(TABLES, {"run": {"mode": "sync"}}) == C.load(text=BASE + "[run]\nmode = 'sync'\n")


def test_a_bad_value_built_gets_the_same_one_line_error():
    with pytest.raises(C.ConfigError) as loaded:
        C.load(text=BASE, overrides=["run.batch_size=0"])
    for tables, sets in [([TABLES, {"run": {"batch_size": 0}}], []), ([TABLES], ["run.batch_size=0"])]:
        with pytest.raises(C.ConfigError) as info:
            C.build(*tables, overrides=sets)
        assert str(info.value) == str(loaded.value)
        assert str(info.value).startswith("config error: run.batch_size = 0: expected an integer >= 1")
        assert "\n" not in str(info.value)
    with pytest.raises(C.ConfigError, match=r"^config error: roles.rollout.pool = 'gen': not a pool; pools: train$"):
        C.build(TABLES, {"pools": {"gen": None}})


def test_at_least_the_sim_example_ships():
    assert any(p.name == "sim.toml" for p in SHIPPED)


def test_every_config_field_has_a_docstring():
    assert C.undocumented_fields() == []


def test_overrides_go_through_the_same_validation():
    config = C.load(text=BASE, overrides=["run.steps=3", "run.mode=sync", "roles.rollout.engine.slots=16"])
    assert config.run.steps == 3 and config.run.mode == "sync" and config.run.max_staleness == 0
    assert config.roles.rollout.engine.slots == 16
    inline = C.load(text=BASE, overrides=['roles.rollout.engine.response_len={kind="fixed", value=10}'])
    assert inline.roles.rollout.engine.response_len == C.Fixed(value=10)
    # One key of a table left at its default: the default's kind is kept.
    sigma = C.load(text=BASE, overrides=["roles.rollout.engine.response_len.sigma=2"])
    assert sigma.roles.rollout.engine.response_len == C.LogNormal(median=256, sigma=2.0, min=1, max=4096)


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ('run.mode="fast"', "config error: run.mode = 'fast': expected one of 'async', 'one_step', 'sync'"),
        ("run.batch_size=0", "config error: run.batch_size = 0: expected an integer >= 1"),
        ("run.batch_size=1.5", "config error: run.batch_size = 1.5: expected an integer >= 1"),
        ("run.foo=1", "config error: run.foo = 1: unknown key; run takes: mode, max_staleness,"),
        ('roles.rollout.pool="x"', "config error: roles.rollout.pool = 'x': not a pool; pools: gen, train"),
        ('roles.rollout.engine.kind="vllmx"', "config error: roles.rollout.engine.kind = 'vllmx': expected one of"),
        ("roles.rollout.engine.slots=-1", "config error: roles.rollout.engine.slots = -1: expected an integer >= 1"),
        ('pools.gen.strategy="X"', "config error: pools.gen.strategy = 'X': expected one of 'PACK', 'SPREAD'"),
        ("roles.rollout.engine.response_len={sigma=2}",
         "config error: roles.rollout.engine.response_len.kind = (missing): required: one of 'fixed', 'lognormal', "
         "'pareto'"),
        ("roles.teacher.replicas=2", "config error: roles.teacher.pool = (missing): not a pool; pools: gen, train"),
        ("roles.reward.launch='external'",
         "config error: roles.reward.pool = 'gen': an external role (launch = 'external') runs on no pool"),
        ("pools.spare.nodes=1", "config error: pools.spare = {"),
        ("run.max_staleness=3", None),  # fine in async mode
        ("nonsense", "config error: --set nonsense = 'nonsense': expected KEY.PATH=VALUE"),
        ("run.steps.x=1", "config error: run.steps = 20: is not a table, so run.steps.x cannot be set"),
    ],
)
def test_bad_values_get_one_line_naming_key_value_and_allowed(override, line):
    if line is None:
        assert C.load(text=BASE, overrides=[override]).run.max_staleness == 3
        return
    with pytest.raises(C.ConfigError) as info:
        C.load(text=BASE, overrides=[override])
    text = str(info.value)
    assert text.startswith(line)
    assert "\n" not in text


def test_cross_field_checks():
    with pytest.raises(C.ConfigError, match=r"run.max_staleness = 2: must be 0 \(or left out\) when run.mode = 'sync'"):
        C.load(text=BASE, overrides=["run.mode=sync", "run.max_staleness=2"])
    with pytest.raises(C.ConfigError, match="pools.spare = .*no role runs on this pool"):
        C.load(text=BASE + "[pools.spare]\n")


def test_a_reproducible_run_is_sync_and_plays_no_episodes():
    assert C.load(text=BASE, overrides=["run.mode=sync", "run.deterministic=true"]).run.deterministic
    for mode in ("async", "one_step"):
        with pytest.raises(C.ConfigError, match=rf"run.deterministic = true: .* 'sync' alone \(here '{mode}'"):
            C.load(text=BASE, overrides=[f"run.mode={mode}", "run.deterministic=true"])
    env = BASE + '[roles.env]\npool = "gen"\nenvironment = { path = "envs:Count" }\n'
    with pytest.raises(C.ConfigError, match=r"run.deterministic = true: episodes .* not reproducible"):
        C.load(text=env, overrides=["run.mode=sync", "run.deterministic=true"])


def test_the_signal_filter_needs_groups_that_can_differ():
    assert C.load(text=BASE, overrides=["run.filter=signal"]).run.filter == "signal"
    with pytest.raises(C.ConfigError,
                       match=r"run.filter = .signal.: a group of one sample .*run.samples_per_prompt >= 2"):
        C.load(text=BASE, overrides=["run.filter=signal", "run.samples_per_prompt=1"])
    with pytest.raises(C.ConfigError,
                       match=r"run.filter = 'signal': the critic's advantages .* are not group-relative"):
        C.load(ROOT / "examples" / "ppo.toml", ["run.filter=signal", "run.samples_per_prompt=4"])
    with pytest.raises(C.ConfigError, match=r"run.filter = 'signal': with distillation"):
        C.load(ROOT / "examples" / "distill.toml", ["run.filter=signal"])
    with pytest.raises(C.ConfigError, match=r"run.filter = 'signals'"):
        C.load(text=BASE, overrides=["run.filter=signals"])


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_one_flag_switches_a_shipped_config_to_sync(path):
    config = C.load(path, ["run.mode=sync"])
    assert config.run.mode == "sync" and config.run.max_staleness == 0


def test_the_mode_implies_its_staleness_unless_both_are_set():
    pinned = BASE + "[run]\nmode = 'async'\nmax_staleness = 2\n"
    # A --set of the mode alone: the file's bound was the other mode's.
    sync = C.load(text=pinned, overrides=["run.mode=sync"])
    assert sync.run.max_staleness_given is None and sync.run.max_staleness == 0
    assert C.load(text=pinned, overrides=["run.mode=one_step"]).run.max_staleness == 1
    # The other way: a file pinned for sync, run async, gets async's default.
    back = C.load(text=BASE + "[run]\nmode = 'sync'\nmax_staleness = 0\n", overrides=["run.mode=async"])
    assert back.run.mode == "async" and back.run.max_staleness == 2
    # The file's own mode set again changes nothing: its bound stays.
    assert C.load(text=BASE + "[run]\nmax_staleness = 4\n", overrides=["run.mode=async"]).run.max_staleness == 4
    # Both given: the user's word, checked; inconsistent is still an error, from --set or from the file.
    assert C.load(text=pinned, overrides=["run.mode=async", "run.max_staleness=5"]).run.max_staleness == 5
    assert C.load(text=pinned, overrides=["run.mode=sync", "run.max_staleness=0"]).run.max_staleness == 0
    wrong = r"run.max_staleness = 2: must be 0 \(or left out\) when run.mode = 'sync'"
    with pytest.raises(C.ConfigError, match=wrong):
        C.load(text=pinned, overrides=["run.max_staleness=2", "run.mode=sync"])
    with pytest.raises(C.ConfigError, match=wrong):
        C.load(text=BASE + "[run]\nmode = 'sync'\nmax_staleness = 2\n")
    with pytest.raises(C.ConfigError,
                       match=r"run.max_staleness = 3: must be 1 \(or left out\) when run.mode = 'one_step'"):
        C.load(text=BASE + "[run]\nmode = 'sync'\n", overrides=["run.mode=one_step", "run.max_staleness=3"])


def test_trainer_ranks_on_gpus_take_a_gpu_each():
    # On CPUs any number of ranks share the pool's cores.
    assert C.load(text=BASE, overrides=["roles.trainer.replicas=2"]).roles.trainer.replicas == 2
    gpus = ["pools.train.gpus_per_bundle=1", "roles.trainer.replicas=2"]
    with pytest.raises(C.ConfigError, match=r"roles.trainer.replicas = 2: trainer ranks on GPUs need a GPU each; "
                                            r"pool 'train' gives each replica 0.5"):
        C.load(text=BASE, overrides=gpus)
    assert C.load(text=BASE, overrides=[*gpus, "pools.train.bundles_per_node=2"]).roles.trainer.replicas == 2


def test_unreadable_and_invalid_files(tmp_path):
    with pytest.raises(C.ConfigError, match="cannot be read"):
        C.load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\n")
    with pytest.raises(C.ConfigError, match="is not valid TOML"):
        C.load(bad)


def test_cli_config_error_is_one_line_and_exit_status_2(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "rlflow", "up", "--config", str(ROOT / "examples" / "sim.toml"),
         "--set", "run.mode=fast", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "config error: run.mode = 'fast': expected one of 'async', 'one_step', 'sync'"
    assert "Traceback" not in done.stderr


def test_run_dir_template():
    import datetime

    config = C.load(text=BASE, overrides=['run.run_dir="out/x-{time}"'])
    when = datetime.datetime(2026, 1, 2, 3, 4, 5)
    assert C.resolve_run_dir(config, now=when) == pathlib.Path("out/x-20260102-030405")
    assert C.resolve_run_dir(config, "elsewhere") == pathlib.Path("elsewhere")


def test_the_launcher_resolves_the_model_and_paths_once(tmp_path, monkeypatch):
    from rlflow.control.launch import resolve
    from rlflow.models import SHIPPED

    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path / "cache"))  # nothing built: the default model ships
    real = C.load(ROOT / "rlflow" / "defaults" / "default.toml")
    assert resolve(real).roles.rollout.model == str(SHIPPED.resolve()) == str(ROOT / "rlflow" / "defaults" /
                                                                             "arith-qwen2-4x256")
    teacher = C.load(ROOT / "examples" / "distill.toml")
    with pytest.raises(C.ConfigError, match="the default-teacher model is not built yet"):
        resolve(teacher)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")
    mine = C.load(ROOT / "rlflow" / "defaults" / "default.toml", ["roles.rollout.model=mine", "run.resume=ckpt"])
    resolved = resolve(mine)
    assert resolved.roles.rollout.model == str(tmp_path / "mine")
    assert resolved.run.resume == str(tmp_path / "ckpt") and resolved.policy_path == str(tmp_path / "ckpt")
    with pytest.raises(C.ConfigError,
                       match="roles.rollout.model = 'nowhere': .* is not a Hugging Face model directory"):
        resolve(C.load(ROOT / "rlflow" / "defaults" / "default.toml", ["roles.rollout.model=nowhere"]))
    # Simulated engines load no model: nothing to resolve.
    assert resolve(C.load(ROOT / "examples" / "sim.toml")).roles.rollout.model == "default"


def test_config_show_prints_the_effective_config_which_loads_back_the_same(capsys, tmp_path):
    import tomllib

    from rlflow.tools.cli import main

    assert main(["config", "show", "--set", "run.steps=7", "--set", "roles.rollout.engine.max_tokens=50"]) == 0
    text = capsys.readouterr().out
    raw = tomllib.loads(text)
    assert raw["run"]["steps"] == 7 and raw["roles"]["trainer"]["engine"]["loss_norm"]  # defaults filled in
    (tmp_path / "shown.toml").write_text(text)
    assert C.load(tmp_path / "shown.toml") == C.load(ROOT / "rlflow" / "defaults" / "default.toml",
                                                     ["run.steps=7", "roles.rollout.engine.max_tokens=50"])
    assert main(["config", "show", "--set", "run.stepz=7"]) == 2
    assert "run.stepz = 7: unknown key" in capsys.readouterr().err


def test_a_renamed_key_is_refused_with_its_new_name():
    text = (ROOT / "examples" / "ppo.toml").read_text()
    assert "\nmax_steps_owed = 1" in text
    with pytest.raises(C.ConfigError) as caught:
        C.load(text=text.replace("\nmax_steps_owed = 1", "\nmax_staleness = 1", 1))
    assert caught.value.key == "roles.critic.max_staleness" and "roles.critic.max_steps_owed" in str(caught.value)


def test_the_mismatch_corrections_bounds_are_checked():
    ppo = ROOT / "examples" / "ppo.toml"
    key = "roles.trainer.engine."
    fine = C.load(ppo, [key + "decoupled=true", key + "correction='truncate'", key + "objective='gspo'"])
    assert (fine.roles.trainer.engine.correction, fine.roles.trainer.engine.objective) == ("truncate", "gspo")
    for overrides, message in [
        ([key + "correction='truncate'"], r"correction = 'truncate': truncation .* needs decoupled = true"),
        ([key + "decoupled=true", key + "correction='truncate'", key + "correction_low=0.5"],
         r"correction_low = 0.5: a lower bound is mask's"),
        ([key + "correction='mask'", key + "correction_low=3.0"], r"correction_low = 3.0: must be below "
                                                                   r"correction_high \(2.0\)"),
        ([key + "overlong_buffer=500"], r"overlong_buffer = 500: must be below the rollout's max_tokens"),
        ([key + "tis_cap=2.0"], r"roles.trainer.engine.tis_cap = 2.0: is now roles.trainer.engine.correction_high"),
    ]:
        with pytest.raises(C.ConfigError, match=message):
            C.load(ppo, overrides)

"""The role registry: the one list of roles, which the wire, the config and the services agree with."""

from __future__ import annotations

import pathlib

import msgspec
import pytest

from rlflow import config as C
from rlflow.protocol import Role, SampleBatch
from rlflow.roles import BY_NAME, EXTERNAL, NAMES, ROLES, STATEFUL, hook

ROOT = pathlib.Path(__file__).resolve().parent.parent


def role_table(name: str) -> tuple[type, bool]:
    """The config's table of role `name` ([roles.NAME]) and whether a run may leave it out."""
    field = next(f for f in msgspec.inspect.type_info(C.RolesConfig).fields if f.name == name)
    kinds = field.type.types if isinstance(field.type, msgspec.inspect.UnionType) else (field.type,)
    return next(t.cls for t in kinds if isinstance(t, msgspec.inspect.StructType)), not field.required


def test_every_role_is_one_entry_that_the_wire_the_config_and_its_folder_agree_with():
    assert {role.name: role.wire for role in ROLES} == {r.label: r.value for r in Role if r is not Role.CONTROLLER}
    assert set(NAMES) == {f.name for f in msgspec.structs.fields(C.RolesConfig)}
    for role in ROLES:
        module, cls = role.service.split(":")
        path = (ROOT / "services" / module.removeprefix("rlflow.services.").replace(".", "/")).with_suffix(".py")
        assert f"class {cls}(" in path.read_text(), role.service
        table, optional = role_table(role.name)
        assert role.optional == optional, role.name
        # A user may start the replicas of a role whose config says how it is launched.
        assert role.external == ("launch" in table.__struct_fields__), role.name
        # A role whose state is its own stops the run when one of its replicas is lost: rlflow starts it.
        assert not (role.stateful and role.external), role.name
        # Its table is in the config's module of its name or in its own folder; what it attaches, columns.
        assert table.__module__ in (f"rlflow.config.{role.name}", f"rlflow.services.{role.name}.config"), table
        assert set(role.attaches) <= set(SampleBatch.__struct_fields__), role.attaches
    assert STATEFUL == ("critic", "trainer") and set(EXTERNAL) == {"rollout", "env", "reward", "teacher"}
    assert BY_NAME["trainer"].hands_on == "weights" and BY_NAME["env"].takes == "requests"


def test_the_roles_a_config_lists_are_in_the_registrys_order():
    config = C.load(ROOT / "examples" / "ppo.toml")
    names = [name for name, _ in config.role_items()]
    assert names == [n for n in NAMES if n in names] and "critic" in names


#: Outside its folder, what names each role by an identifier besides its entry, the config's root and
#: the wire's stages and columns: the trainer's settings that read its columns (and, for the critic, the
#: simulated trainer's own critic in its process), and the loss and figures that read them.
NAMED_BY = {
    "critic": ["rlflow/config/trainer.py", "services/trainer/sim.py"],
    "teacher": ["rlflow/config/trainer.py", "services/critic/service.py", "services/trainer/torch_engine.py",
                "services/trainer/trained.py"],
}
#: Where every role is named: its registry entry, the config's root (which holds each role's table, its
#: own in the role's folder), the wire's stages and columns.
NAMED_BY_ALL = ["rlflow/roles.py", "rlflow/config/schema.py", "protocol/batch.py", "protocol/checks.py",
                "protocol/messages.py"]


def identifier_words(name: str) -> set[str]:
    """The lower-case words of an identifier, snake_case or CamelCase (`critic_stats` and
    `TorchCritic` both hold the word `critic`)."""
    import re

    return {w.lower() for piece in re.split(r"[._:]+", name)
            for w in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", piece)}


def names_in(source: str) -> set[str]:
    """Every identifier a module's code uses or defines, and every string constant spelled like one
    (a role's name as a key: `BY_NAME["critic"]`); not the prose of its comments and docstrings."""
    import ast

    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        match node:
            case ast.Name(id=name) | ast.Attribute(attr=name) | ast.arg(arg=name) | ast.keyword(arg=str(name)):
                out.add(name)
            case ast.FunctionDef(name=name) | ast.AsyncFunctionDef(name=name) | ast.ClassDef(name=name):
                out.add(name)
            case ast.alias(name=name, asname=asname):
                out |= {name, asname or ""}
            case ast.ImportFrom(module=str(module)):
                out.add(module)
            case ast.Constant(value=str(text)) if text.isidentifier():
                out.add(text)
    return out


def test_names_are_read_by_identifier_not_by_whole_word():
    source = ('critic_stats = 1\nclass TorchCritic: ...\ndef f(): "The critic, in prose."\n'
              'x = BY_NAME["critic"]\n')
    assert {n for n in names_in(source) if "critic" in identifier_words(n)} == {"critic_stats", "TorchCritic",
                                                                                 "critic"}
    prose = '"""the critic\'s values"""\ncriticism = 1  # the critic\n'
    assert not {n for n in names_in(prose) if "critic" in identifier_words(n)}


def _under(path: str, place: str) -> bool:
    return path == place or (place.endswith("/") and path.startswith(place))


@pytest.mark.parametrize("role", sorted(NAMED_BY))
def test_a_role_is_named_outside_its_folder_only_by_its_entry_its_config_its_columns_and_their_algorithm(role):
    """What a role is lives in its folder and its registry entry; the tools reach it through the entry
    (`report`, `curves`, `plan`, `batch_stats`, `attaches`, `models`, `asked_by`,
    `RunDir.role_checkpoint`). Read by identifier:
    `critic_stats` names the critic, a docstring's prose does not."""
    naming = sorted(str(path.relative_to(ROOT)) for top in ("rlflow", "services", "protocol")
                    for path in (ROOT / top).rglob("*.py")
                    if not path.is_relative_to(ROOT / "services" / role)
                    and any(role in identifier_words(name) for name in names_in(path.read_text())))
    allowed = [*NAMED_BY_ALL, *NAMED_BY[role]]
    strays = [path for path in naming if not any(_under(path, place) for place in allowed)]
    assert strays == [], f"modules outside services/{role}/ that name the {role}: {strays}"
    # Each place allowed to name it does: a stale entry would let a stray in there unseen.
    assert [place for place in allowed if not any(_under(path, place) for path in naming)] == []
    # Its entry's hooks resolve.
    for path in (BY_NAME[role].report, BY_NAME[role].plan, BY_NAME[role].batch_stats):
        if path:
            assert callable(hook(path)), path


def test_each_family_of_counts_goes_to_the_counters_map_its_role_declares():
    import collections

    from rlflow.protocol import Counters
    from rlflow.roles import COUNTER_FAMILIES
    from rlflow.services.base import typed_counters

    maps = {f.name for f in msgspec.inspect.type_info(Counters).fields if isinstance(f.type, msgspec.inspect.DictType)}
    assert set(COUNTER_FAMILIES.values()) <= maps and len(set(COUNTER_FAMILIES.values())) == len(COUNTER_FAMILIES)
    counts = collections.Counter({"reward.math.ok": 3, "reward.math.timeout": 1, "env.tool.python.ok": 2,
                                  "agents.taken": 5, "samples": 7})
    assert typed_counters(counts, collections.Counter({"malformed": 1})) == Counters(
        samples=7, rejected={"malformed": 1}, reward_calls={"math.ok": 3, "math.timeout": 1},
        env_calls={"tool.python.ok": 2}, agent_events={"taken": 5})
    with pytest.raises(KeyError, match="nonesuch"):
        typed_counters(collections.Counter({"nonesuch.x": 1}))

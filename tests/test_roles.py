"""The role registry: the one list of roles, which the wire, the config and the services agree with."""

from __future__ import annotations

import pathlib

import msgspec
import pytest

from rlflow import config as C
from rlflow.protocol import Role
from rlflow.roles import BY_NAME, EXTERNAL, NAMES, ROLES, STATEFUL

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
    assert STATEFUL == ("critic", "trainer") and set(EXTERNAL) == {"rollout", "env", "reward", "teacher"}
    assert BY_NAME["trainer"].hands_on == "weights" and BY_NAME["env"].takes == "requests"


def test_the_roles_a_config_lists_are_in_the_registrys_order():
    config = C.load(ROOT / "examples" / "ppo.toml")
    names = [name for name, _ in config.role_items()]
    assert names == [n for n in NAMES if n in names] and "critic" in names


#: Outside its folder, what names each role besides its entry: the config, the wire's columns, and the
#: algorithm that reads them (GAE; the KL and distillation terms) with the trainer's loss.
NAMED_BY = {
    "critic": ["rlflow/algo/values.py"],
    "teacher": ["rlflow/algo/losses.py"],
}


@pytest.mark.parametrize("role", sorted(NAMED_BY))
def test_a_role_is_named_outside_its_folder_only_by_its_entry_its_config_its_columns_and_their_algorithm(role):
    """What a role is lives in its folder and its registry entry; the tools reach it through the entry
    (`report`, `curves`, `plan`, `models`, `asked_by`, `RunDir.role_checkpoint`)."""
    import importlib
    import re

    word = re.compile(rf"\b{role}\b", re.IGNORECASE)
    naming = sorted(str(path.relative_to(ROOT)) for top in ("rlflow", "services", "protocol")
                    for path in (ROOT / top).rglob("*.py")
                    if not path.is_relative_to(ROOT / "services" / role) and word.search(path.read_text()))
    assert naming == sorted(["protocol/batch.py", "protocol/messages.py", "rlflow/config/checks.py",
                             "rlflow/config/schema.py", "rlflow/roles.py", "services/trainer/torch_engine.py",
                             *NAMED_BY[role]])
    # Its entry's hooks resolve.
    for hook in (BY_NAME[role].report, BY_NAME[role].plan):
        if hook:
            module, _, name = hook.partition(":")
            assert callable(getattr(importlib.import_module(module), name)), hook

"""Who sends to whom: plain code, no I/O.

The roles form one chain in the registry's order (`rlflow.roles.ROLES`: rollout
-> reward -> ... -> trainer, the optional ones where the config has them).
Each replica streams to every registered replica of the next role that binds
an ``in`` endpoint; of a role that trains (`RoleSpec.stateful`) only rank 0
takes the stream. Trainer rank 0 deals each step's shares to the other
ranks' ``share`` endpoints; another such role's rank 0 drives its other ranks
over their own process group, and they bind nothing.

Beside the chain, a role may be asked by request and reply (`ASKED`, the
registry's `RoleSpec.asked_by`), e.g. the env role, asked by the rollout. Each
replica of the asking role gets the endpoint named after the asked role of
every registered replica of it, under that name; the asked role streams to
no one.
"""

from __future__ import annotations

from collections.abc import Iterable

from rlflow.control.replicas import Replica, Roster
from rlflow.protocol import Peers
from rlflow.roles import ROLES


#: Roles asked by request and reply rather than streamed to: role -> the role that asks it.
ASKED = {role.name: role.asked_by for role in ROLES if role.asked_by}


class Topology:
    """The chain of roles of one run, and the roles asked beside it."""

    def __init__(self, roles: list[str]):
        self.roles = [role for role in roles if role not in ASKED]
        self.asked = {role: ASKED[role] for role in roles if role in ASKED}

    def next(self, role: str) -> str | None:
        """The role `role` streams to (None: the last, or a role asked beside the chain)."""
        if role in self.asked:
            return None
        i = self.roles.index(role)
        return self.roles[i + 1] if i + 1 < len(self.roles) else None

    def previous(self, role: str) -> str | None:
        """The role that streams to `role`, or asks it (None: the first)."""
        if role in self.asked:
            return self.asked[role]
        i = self.roles.index(role)
        return self.roles[i - 1] if i > 0 else None

    def streams(self, role: str) -> bool:
        """Whether `role` is in the chain (what it holds is on its way to the trainer)."""
        return role in self.roles

    def peers(self, role: str, rank: int, replicas: Iterable[Replica]) -> dict[str, list[str]]:
        """``out``: the ``in`` endpoint of every registered replica of the next
        role; to trainer rank 0 (the last role), ``shares``: the ``share``
        endpoint of each other rank, in rank order; to a role that asks
        another (`ASKED`), that role's endpoints under its name."""
        replicas = sorted(replicas, key=lambda r: (r.role, r.rank))
        if role in self.asked:
            return {}
        asked = {name: [r.hello.endpoints[name] for r in replicas
                        if r.role == name and r.registered and name in r.hello.endpoints]
                 for name, asker in self.asked.items() if asker == role}
        after = self.next(role)
        if after is None:
            shares = [r.hello.endpoints.get("share", "") for r in replicas if r.role == role and r.rank > 0]
            return {"shares": shares} if rank == 0 and shares else {}
        return {"out": [r.hello.endpoints["in"] for r in replicas
                        if r.role == after and r.registered and "in" in r.hello.endpoints], **asked}

    @staticmethod
    def shm_peers(replica: Replica, peers: dict[str, list[str]], replicas: Iterable[Replica]) -> list[str]:
        """The addresses in `peers` bound by replicas that can map the shared
        memory of `replica` and take it (the same non-empty `Hello.shm`)."""
        token = replica.hello.shm
        if not token:
            return []
        takers = {address for r in replicas if r.hello.shm == token for address in r.hello.endpoints.values()}
        return sorted({address for addresses in peers.values() for address in addresses if address in takers})

    @staticmethod
    def text_peers(peers: dict[str, list[str]], replicas: Iterable[Replica]) -> list[str]:
        """The addresses in `peers` bound by replicas that asked for the text of each response
        (`Hello.text`)."""
        askers = {address for r in replicas if r.hello.text for address in r.hello.endpoints.values()}
        return sorted({address for addresses in peers.values() for address in addresses if address in askers})

    def upstream(self, role: str, roster: Roster) -> list[tuple[Replica, Peers]]:
        """What to tell each live replica of the role before `role`: stream to `role`'s replicas'
        current endpoints."""
        before = self.previous(role)
        if not before:
            return []
        out = []
        for upstream in roster.role(before):
            if upstream.live:
                peers = self.peers(before, upstream.rank, roster)
                out.append((upstream, Peers(peers=peers, shm_peers=self.shm_peers(upstream, peers, roster),
                                            text_peers=self.text_peers(peers, roster))))
        return out

"""Weight rounds: moving each new policy version from the trainer to every
replica that loads weights, one version at a time, and the generations of
a collective weight group (`Weights`).

Plain synchronous code, no I/O. A collective transfer needs the sender and
every receiver to take part in the same broadcast, so only one version is
in flight; a version published meanwhile waits, and a newer one replaces it
(replicas skip straight to the newest).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from rlflow.control.checksums import Checksums
from rlflow.errors import RunFailed
from rlflow.protocol import (
    Adapter, Evaluate, ParamSpec, SendWeights, UpdateWeights, WeightsGloo, WeightsNccl, WeightTransfer,
)


class WeightRounds:
    """Which version is moving, and who has loaded it."""

    def __init__(self, version: int = 0):
        #: The newest version the trainer has published.
        self.published = version
        #: The version being moved now, if any.
        self.moving: int | None = None
        #: The newest version sent (or held by every receiver from the start).
        self.moved = version
        self._loaded: set[int] = set()
        #: No round starts while held (one moving goes on): a held-out evaluation reads one version.
        self.held = False

    def publish(self, version: int) -> int | None:
        """The trainer has `version`; the version to start moving now, if none is moving."""
        self.published = max(self.published, version)
        return self._start()

    def loaded(self, rank: int, version: int, receivers: set[int]) -> int | None:
        """Receiver `rank` now holds `version`; `receivers` are the ranks that
        take part. The next version to move, when this round is complete.

        A receiver that holds a newer version than the one moving has done
        its part: a weight server may hand out its newest version, published
        after this round started.
        """
        if self.moving is not None and version >= self.moving:
            self._loaded.add(rank)
        return self._check(receivers)

    def left(self, receivers: set[int]) -> int | None:
        """A receiver is gone: the round may now be complete without it."""
        return self._check(receivers)

    def _check(self, receivers: set[int]) -> int | None:
        if self.moving is not None and receivers <= self._loaded:
            self.moving = None
            return self._start()
        return None

    def hold(self) -> None:
        """Start no round until `release` (the one moving, if any, completes)."""
        self.held = True

    def release(self) -> int | None:
        """Rounds start again: the version to move now, if one waits."""
        self.held = False
        return self._start()

    def _start(self) -> int | None:
        if self.moving is None and not self.held and self.published > self.moved:
            self.moving, self._loaded = self.published, set()
            self.moved = self.published
            return self.moving
        return None

    @property
    def busy(self) -> bool:
        """Whether a version is moving now."""
        return self.moving is not None

    def abandon(self) -> None:
        """The round moving cannot complete (its broadcast broke): forget it."""
        self.moving, self._loaded = None, set()

    def repeat(self) -> int | None:
        """Move the newest version sent again (e.g. to a replica that joined
        late, through a new collective group); None if a round is moving."""
        if self.moving is not None:
            return None
        self.moving, self._loaded = self.moved, set()
        return self.moving


@dataclass(frozen=True)
class Order:
    """A message for the trainer's ranks (`rank` None: every rank) or for
    rollout replica `rank`."""

    role: str
    rank: int | None
    message: SendWeights | UpdateWeights | Evaluate


class Weights:
    """Each replica's weight state, and what to tell whom to move versions.

    Wraps the rounds (one version moving at a time) and the collective
    group's generations: a collective group cannot take a new member, so
    after a receiver left or joined, the next round makes a new generation
    (`SendWeights` with a `transfer`: the trainer hosts it and says where in
    `WeightsGroup`; then each live receiver gets `UpdateWeights` with its
    rank in it). A replacement rollout replica is caught up before it gets
    work. A broken broadcast abandons the round and moves the newest version
    again through a new generation, at most `max_rebuilds` times in a row.
    Every replica's report of a version it loaded is checked against the
    trainer's checksum of it (`checksums`). Every method returns the orders
    to send, and changes nothing else (or raises `RunFailed`).
    """

    def __init__(self, version: int, *, max_rebuilds: int):
        self.rounds = WeightRounds(version)
        self.max_rebuilds = max_rebuilds
        #: The trainer's offer (from its hello) and the layout of its flat buffer.
        self.offer: WeightTransfer | None = None
        self.layout: list[ParamSpec] = []
        #: The LoRA adapter the trainer's updates carry (None: whole weights).
        self.adapter: Adapter | None = None
        self.checksums = Checksums(version)
        self.generation = 0
        #: The receivers of the current generation, in member order (member i + 1 is members[i]).
        self.members: list[int] = []
        #: The next round makes a new generation of the collective group.
        self.regroup = False
        #: The version moving through a new generation, until the trainer says where the group is.
        self.moving_version: int | None = None
        #: Broken broadcasts since the last round completed.
        self.rebuilds = 0
        #: Rollout replicas being caught up (replacements): no work for them yet.
        self.catching_up: set[int] = set()
        #: An evaluation asked for, waiting for the round moving to end (its sampling temperature).
        self.eval_due: float | None = None

    def offered(self, transfer: WeightTransfer | None, layout: list[ParamSpec], receivers: int,
                adapter: Adapter | None = None) -> None:
        """The trainer's rank 0 said how it sends weights (an `adapter`'s, or
        whole ones); `receivers` rollout replicas make the first generation
        of a collective group."""
        self.offer, self.layout, self.members = transfer, layout, list(range(receivers))
        self.adapter = adapter

    @property
    def collective(self) -> bool:
        return isinstance(self.offer, (WeightsGloo, WeightsNccl))

    @property
    def busy(self) -> bool:
        return self.rounds.busy

    def welcome(self, role: str, rank: int, *, first: bool, receivers: int) -> dict:
        """The fields of the `Welcome` about weights (`weights`, `layout`,
        `adapter`): the trainer's rank 0 hosts the group of 1 + `receivers`
        members; a first rollout replica joins it as member 1 + rank; a
        replacement joins the next generation (when it is caught up); with the
        zmq transfer every rollout replica gets the trainer's address (and
        the layout: an adapter's tensors). Every rollout replica gets the
        adapter it serves."""
        offer, adapter = self.offer, self.adapter if role == "rollout" else None
        if self.collective:
            assert offer is not None  # collective: the offer is a WeightsGloo or WeightsNccl
            group = msgspec.structs.replace(offer, world_size=1 + receivers)
            if role == "trainer" and rank == 0:
                return {"weights": group}
            if role == "rollout" and first:
                return {"weights": msgspec.structs.replace(group, rank=1 + rank), "layout": self.layout,
                        "adapter": adapter}
            if role == "rollout":
                return {"layout": self.layout, "adapter": adapter}
            return {}
        return {"weights": offer, "layout": self.layout, "adapter": adapter} if role == "rollout" else {}

    def publish(self, version: int, receivers: set[int], checksum: str = "") -> list[Order]:
        """The trainer has `version`, whose weights have `checksum` (empty: not checked)."""
        self.checksums.publish(version, checksum)
        return self._move(self.rounds.publish(version), receivers)

    def loaded(self, rank: int, version: int, receivers: set[int], checksum: str = "") -> list[Order]:
        """Rollout replica `rank` holds `version` now, received with `checksum`
        (it may take work, if it was catching up). Raises `RunFailed` if the
        checksum is not the trainer's."""
        self.checksums.served(f"rollout-{rank}", version, checksum)
        if version >= self.rounds.moved:
            self.catching_up.discard(rank)
        return self._move(self.rounds.loaded(rank, version, receivers), receivers)

    def left(self, rank: int, receivers: set[int]) -> list[Order]:
        """Rollout replica `rank` is gone: the next round regroups; this one may complete without it. Rollout
        0's evaluation, asked or under way, is lost with it: rounds start again (the controller asks its
        replacement)."""
        self.catching_up.discard(rank)
        self.regroup = self.collective
        orders = self._move(self.rounds.left(receivers), receivers)
        if rank == 0 and self.rounds.held:
            self.eval_due = None
            orders += self.release(receivers)
        return orders + self.evaluation()

    def joined(self, rank: int, receivers: set[int]) -> list[Order]:
        """A replacement rollout replica is ready: it loads the newest version moved before any work."""
        self.catching_up.add(rank)
        if self.collective:
            self.regroup = True
            return [] if self.rounds.busy else self._move(self.rounds.repeat(), receivers)
        return [Order("rollout", rank, UpdateWeights(version=self.rounds.moved))]

    def hold(self) -> None:
        """Start no new round (one moving completes): a held-out evaluation is to read the version the
        rollout replicas hold once it has."""
        self.rounds.hold()

    def evaluate(self, temperature: float) -> list[Order]:
        """A held-out evaluation by rollout 0 of one version: no new round starts (see `hold`), and it is
        asked once the round moving has ended (`evaluation`)."""
        self.hold()
        self.eval_due = temperature
        return self.evaluation()

    def evaluation(self) -> list[Order]:
        """The evaluation due, once no round is moving."""
        if self.eval_due is None or self.busy:
            return []
        temperature, self.eval_due = self.eval_due, None
        return [Order("rollout", 0, Evaluate(version=self.rounds.moved, temperature=temperature))]

    def release(self, receivers: set[int]) -> list[Order]:
        """Rounds start again, from the newest version published."""
        return self._move(self.rounds.release(), receivers)

    def hosted(self, transfer: WeightTransfer, receivers: set[int]) -> list[Order]:
        """The trainer hosts the new generation at `transfer`: each live
        member joins it with its rank, and loads the version moving."""
        if not isinstance(transfer, WeightsGloo | WeightsNccl):  # no generations to join over ZeroMQ
            return []
        if transfer.generation != self.generation:  # one replaced before the trainer got to it: nobody joins it
            return []
        version, self.moving_version = self.moving_version, None
        if version is None:
            return []
        replace = msgspec.structs.replace
        return [Order("rollout", rank, UpdateWeights(version=version, transfer=replace(transfer, rank=m)))
                for m, rank in enumerate(self.members, start=1) if rank in receivers]

    def broken(self, receivers: set[int]) -> list[Order]:
        """A broadcast failed: abandon the round, move the newest version
        again through a new generation. Raises `RunFailed` after
        `max_rebuilds` in a row with no round completed."""
        if not self.collective:
            return []
        self.rebuilds += 1
        if self.rebuilds > self.max_rebuilds:
            raise RunFailed(f"the weight group broke {self.rebuilds} times in a row without a round completing "
                            f"(cluster.max_weight_rebuilds = {self.max_rebuilds})")
        self.regroup = True
        self.rounds.abandon()
        return self._move(self.rounds.repeat(), receivers)

    def _move(self, version: int | None, receivers: set[int]) -> list[Order]:
        """Start moving `version`, if there is one: every trainer rank sends
        it (hosting a new generation first, when one is due) and every live
        receiver loads it (told when the trainer says where a new group is)."""
        if version is None:
            if not self.rounds.busy:
                self.rebuilds = 0
            return []
        if not receivers:  # nobody to move it to: done at once; a replica that joins later catches up
            self.rounds.abandon()
            self.regroup = self.collective
            return []
        transfer = None
        if self.regroup and self.collective:
            assert self.offer is not None  # collective: the offer is a WeightsGloo or WeightsNccl
            self.generation += 1
            transfer = msgspec.structs.replace(self.offer, world_size=1 + len(receivers), port=0,
                                               generation=self.generation)
            self.regroup = False
            self.members = sorted(receivers)
            self.moving_version = version
        orders = [Order("trainer", None, SendWeights(version=version, transfer=transfer))]
        if transfer is None:
            orders += [Order("rollout", rank, UpdateWeights(version=version)) for rank in sorted(receivers)]
        return orders

"""Shared memory for large tensors between processes of one machine.

The sending side (`SegmentPool`, one per sending socket) copies a message's
large tensors into a segment it owns and sends only a description of it;
the receiving side (`SegmentMap`, one per receiving socket) maps the segment
and hands out read-only views of the bytes where they lie. The format is
`rlflow.protocol.shm` and SPEC.md, *Tensors in shared memory*; this module
is how rlflow keeps its promises:

* Segments are anonymous (``memfd_create``, mode 0600): nothing is ever
  named in /dev/shm, so no process's death can leave one behind. A receiver
  opens one as ``/proc/<pid>/fd/<fd>`` of its sender, which the kernel allows
  only to processes of the same user (see `host_token` for who can). The
  memory goes back to the system when the last process that holds it
  (sender or receiver) closes or dies. Their names say whose they were
  (``rlflow-<label>-<pid>-<n>``, in ``/proc/<pid>/maps``).
* Segments are reused: a fresh one costs page faults on both sides (64 MiB:
  ~4-8 memcpys' time to write into fresh pages here, against one into pages
  written before), so a sender keeps its segments, and a receiver its
  mappings, for the next message.
* A segment is reused only once its receiver is done with it: when every
  tensor (and every array or torch tensor made from one) of the message is
  gone, the receiver marks it released. A receiver holds an OFD lock on the
  segment while it uses one, so that a receiver that dies holding it is seen
  (the kernel drops its lock) and the segment reused. A segment sent but not
  yet taken is never reused: its message may still be in a queue.
* Memory stays bounded: a pool holds at most `ShmSettings.max_bytes`; when
  no segment is free and no new one fits, the message's tensors travel in
  frames instead (counted in `SegmentPool.fallbacks`), where the sockets'
  high-water marks bound them as before. A message is never held back
  waiting for a segment (a receiver that holds tensors while it waits for
  more would wait forever).
* A closed pool keeps each segment still in flight for the socket's linger
  time (as ZeroMQ keeps unsent messages), and a process that exits waits
  that long for them to be taken; after that they are dropped, and a
  receiver that comes to one later rejects the message (``shm``).
"""

from __future__ import annotations

import atexit
import fcntl
import itertools
import mmap
import os
import re
import stat
import struct
import threading
import time
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from rlflow.protocol.errors import SharedMemoryError
from rlflow.protocol.shm import CONTROL_BYTES, ID_BYTES, MAGIC, WORD, ShmSegment

MiB = 1 << 20

_SENT, _CLAIMED, _RELEASED, _RETIRED = WORD["sent"], WORD["claimed"], WORD["released"], WORD["retired"]
_SIZE, _PID = WORD["size"], WORD["pid"]

#: struct flock on Linux (l_type, l_whence, l_start, l_len, l_pid).
_FLOCK = "hh4xqqi4x"


def host_token() -> str:
    """Who can map this process's segments: a process with the same token.

    ``<boot id>/<PID namespace>/<user id>``: the same running kernel (its
    boot id), the same PID namespace (so the sender's ``/proc/<pid>`` is the
    sender) and the same user (so the kernel lets it open the sender's
    descriptors). Empty where there is no /proc to tell: such a process
    takes no part.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}/{namespace}/{os.getuid()}"


class ShmSettings(NamedTuple):
    """How a sending socket uses shared memory."""

    #: Tensors of at least this many bytes go through shared memory.
    min_bytes: int = MiB
    #: Most bytes of segments the socket's pool holds at once.
    max_bytes: int = 1 << 30
    #: Names the segments (with the process id), e.g. the run's id.
    label: str = ""


def _lock(fd: int, kind: int) -> None:
    """Take (F_RDLCK) or drop (F_UNLCK) this open file's lock on byte 0."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, kind, os.SEEK_SET, 0, 1, 0))


def _locked(fd: int) -> bool:
    """Whether another open file holds a lock on byte 0 of this one's file."""
    got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0))
    return struct.unpack(_FLOCK, got)[0] != fcntl.F_UNLCK


# -- sending --------------------------------------------------------------------


def _size_class(nbytes: int) -> int:
    """Segment size for `nbytes`: rounded up to a quarter or an eighth of its
    power of two, so that messages of similar sizes can share segments and
    no segment is more than a quarter too large."""
    step = 1 << max(12, nbytes.bit_length() - 3)
    return -(-nbytes // step) * step


class _Segment:
    """One segment a sender owns: an anonymous file, mapped."""

    __slots__ = ("fd", "size", "id", "map", "words")

    def __init__(self, name: str, size: int):
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            self.map: mmap.mmap | None = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.size = fd, size
        raw = os.urandom(ID_BYTES)
        self.id = raw.hex()
        self.map[0 : len(MAGIC)] = MAGIC
        self.map[8 : 8 + ID_BYTES] = raw
        self.words: np.ndarray | None = np.frombuffer(self.map, np.uint64, CONTROL_BYTES // 8)
        self.words[_SIZE] = size
        self.words[_PID] = os.getpid()

    def free(self) -> bool:
        """Whether nobody uses what it carries: released, or taken by a
        receiver that has died since (its lock is gone)."""
        words = self.words
        assert words is not None  # open: a closed segment has left its pool
        sent = words[_SENT]
        if words[_RELEASED] == sent:
            return True
        return words[_CLAIMED] == sent and not _locked(self.fd)

    def in_flight(self) -> bool:
        """Sent and not yet taken."""
        words = self.words
        assert words is not None  # open: a closed segment has left its pool
        sent = words[_SENT]
        return words[_CLAIMED] != sent and words[_RELEASED] != sent

    def close(self) -> None:
        """Say it will carry nothing more, and let go of it (a receiver that
        has it mapped keeps the memory until it lets go too)."""
        assert self.words is not None  # closed once, by the pool or the reaper that took it out
        self.words[_RETIRED] = 1
        # Unmapped when the last view goes: a send's copy may still hold one.
        self.words = self.map = None
        os.close(self.fd)


class Placement(NamedTuple):
    """One message's use of a segment."""

    segment: _Segment
    seq: int
    #: Bytes of the segment the message uses, after the control page.
    nbytes: int

    def unsend(self) -> None:
        """The message was not sent after all: the segment is free again."""
        if self.segment.words is not None:
            self.segment.words[_RELEASED] = self.seq


class SegmentPool:
    """A sending socket's segments: reserved one per message, reused."""

    def __init__(self, settings: ShmSettings, name: str):
        self.min_bytes = settings.min_bytes
        self.max_bytes = settings.max_bytes
        # memfd names are at most 249 bytes.
        label = re.sub(r"[^A-Za-z0-9_.-]+", "_", "-".join(filter(None, (settings.label, name))))[:160]
        self._prefix = f"rlflow-{label}-{os.getpid()}-"
        self._segments: list[_Segment] = []
        self._numbers = itertools.count()
        self._reserved: Placement | None = None
        self._closed = False
        #: Messages whose tensors went through shared memory.
        self.placed = 0
        #: Messages whose large tensors went in frames: no segment was free
        #: and no new one fitted under `max_bytes`.
        self.fallbacks = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the segments the pool holds now."""
        return sum(s.size for s in self._segments)

    @property
    def segments(self) -> int:
        """Segments the pool holds now."""
        return len(self._segments)

    def in_use(self) -> int:
        """Segments whose message is in flight or taken and still used."""
        return sum(not s.free() for s in self._segments)

    def reserve(self, nbytes: int) -> tuple[ShmSegment, memoryview] | None:
        """A segment for one message of `nbytes` bytes (control page
        included), marked as carrying it; None if none is free and no new
        one fits (see the module's docstring)."""
        if _lingering:
            _reap()
        segment = None if self._closed else self._find(nbytes)
        if segment is None:
            self.fallbacks += 1
            return None
        assert segment.words is not None and segment.map is not None  # a pool's segments are open
        seq = int(segment.words[_SENT]) + 1
        segment.words[_SENT] = seq
        self._reserved = Placement(segment, seq, nbytes - CONTROL_BYTES)
        self.placed += 1
        described = ShmSegment(pid=os.getpid(), fd=segment.fd, id=segment.id, seq=seq, size=segment.size)
        return described, memoryview(segment.map)

    def take_reserved(self) -> Placement | None:
        """The reservation `reserve` made last, if any, for its sender to keep
        (it must be taken before anything else can reserve)."""
        placed, self._reserved = self._reserved, None
        return placed

    def _find(self, nbytes: int) -> _Segment | None:
        fits = sorted((s for s in self._segments if s.size >= nbytes), key=lambda s: s.size)
        best = next((s for s in fits if s.free()), None)
        if best is not None and best.size <= 4 * nbytes:
            return best
        size = _size_class(nbytes)
        if size > self.max_bytes:
            return best
        if self.nbytes + size > self.max_bytes:
            # Make room by letting go of free segments, smallest first (the
            # large ones cost the most page faults to make again).
            for old in sorted(self._segments, key=lambda s: s.size):
                if old is not best and old.free():
                    self._drop(old)
                    if self.nbytes + size <= self.max_bytes:
                        break
        if self.nbytes + size > self.max_bytes:
            return best
        segment = _Segment(f"{self._prefix}{next(self._numbers)}", size)
        self._segments.append(segment)
        return segment

    def _drop(self, segment: _Segment) -> None:
        self._segments.remove(segment)
        segment.close()

    def close(self, linger_ms: int) -> None:
        """Let go of every segment; one still in flight is kept for
        `linger_ms` or until it is taken, whichever comes first."""
        self._closed = True
        deadline = time.monotonic() + linger_ms / 1000
        lingering = False
        with _lock_lingering:
            for segment in self._segments:
                if linger_ms > 0 and segment.in_flight():
                    assert segment.words is not None  # a pool's segments are open
                    segment.words[_RETIRED] = 1
                    _lingering.append((deadline, segment))
                    lingering = True
                else:
                    segment.close()
        self._segments = []
        if lingering:
            timer = threading.Timer(linger_ms / 1000, _reap)
            timer.daemon = True
            timer.start()


#: Segments of closed pools still in flight: (deadline, segment).
_lingering: list[tuple[float, _Segment]] = []
#: Pools close on their sockets' thread; a timer reaps on its own.
_lock_lingering = threading.Lock()


def _reap() -> None:
    """Let go of lingering segments that have been taken or whose time is up."""
    now = time.monotonic()
    with _lock_lingering:
        for item in list(_lingering):
            deadline, segment = item
            if now >= deadline or not segment.in_flight():
                _lingering.remove(item)
                segment.close()


@atexit.register
def _linger_at_exit() -> None:
    """Give the receivers of lingering segments until their deadlines (as
    ZeroMQ's context does for unsent messages)."""
    while _lingering:
        _reap()
        if _lingering:
            time.sleep(0.001)


# -- receiving ------------------------------------------------------------------


class _Mapped:
    """A segment of another process, mapped by this one."""

    __slots__ = ("fd", "size", "pid", "words", "address", "claims", "closing")

    def __init__(self, segment: ShmSegment):
        path = f"/proc/{segment.pid}/fd/{segment.fd}"
        try:
            # Checked before it is opened (a description could name a device)
            # and again once open (it could have changed in between): only a
            # private file of this user, of the size described.
            _check_file(path, os.stat(path), segment.size)
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
        except OSError as exc:
            raise SharedMemoryError(
                f"cannot open segment {path}: {exc.strerror} (has its sender exited, or does it run as another "
                "user or in another PID namespace?)"
            ) from None
        try:
            _check_file(path, os.fstat(fd), segment.size)
            try:
                view = np.frombuffer(mmap.mmap(fd, segment.size), np.uint8)
            except (OSError, ValueError) as exc:
                raise SharedMemoryError(f"cannot map {path}: {exc}") from None
            if bytes(view[: len(MAGIC)]) != MAGIC or bytes(view[8 : 8 + ID_BYTES]).hex() != segment.id:
                raise SharedMemoryError(f"{path} is not segment {segment.id}")
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.size, self.pid = fd, segment.size, segment.pid
        self.words: np.ndarray | None = view[:CONTROL_BYTES].view(np.uint64)
        self.address = view.ctypes.data
        self.claims = 0
        self.closing = False

    def claim(self, seq: int) -> _Claim:
        words = self.words
        assert words is not None  # mapped: an unmapped segment has left its map
        sent = int(words[_SENT])
        if sent != seq:
            raise SharedMemoryError(f"segment carries message {sent}, not {seq}: the description is stale or forged")
        if words[_CLAIMED] == seq:
            raise SharedMemoryError(f"message {seq} of this segment was taken before")
        _lock(self.fd, fcntl.F_RDLCK)
        words[_CLAIMED] = seq
        self.claims += 1
        return _Claim(self, seq)

    def stale(self) -> bool:
        """Retired by its sender, or its sender is gone."""
        assert self.words is not None  # mapped: an unmapped segment has left its map
        if self.words[_RETIRED]:
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # a process of another user has the pid now
            return True
        return False

    def close(self) -> None:
        """Unmap now if nothing is taken, else when the last claim ends."""
        self.closing = True
        if self.claims == 0:
            self._unmap()

    def _unmap(self) -> None:
        # The views of the mapping are the claims' and this: once all are
        # gone the mapping is unmapped. A claim released on another thread
        # may get here as a sweep does.
        fd, self.fd, self.words = self.fd, -1, None
        if fd >= 0:
            os.close(fd)


def _check_file(path: str, info: os.stat_result, size: int) -> None:
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise SharedMemoryError(f"{path} is not a private file of this user (mode {info.st_mode:o})")
    if info.st_size != size:
        raise SharedMemoryError(f"{path} has {info.st_size} bytes, its description says {size}")


class _Claim:
    """One message's hold on a segment; released when the last view of its
    tensors goes."""

    __slots__ = ("mapped", "seq")

    def __init__(self, mapped: _Mapped, seq: int):
        self.mapped, self.seq = mapped, seq

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """A read-only array of the segment's bytes [offset, offset + nbytes)
        that keeps this claim alive."""
        return np.asarray(_View(self, self.mapped.address + offset, nbytes))

    def __del__(self) -> None:
        mapped = self.mapped
        # Unlocking is a system call, so the release below is seen only
        # after every read of the tensors' bytes. (The mapping stays until
        # the last claim ends: its descriptor is open here.)
        _lock(mapped.fd, fcntl.F_UNLCK)
        assert mapped.words is not None  # unmapped only once its last claim ends
        mapped.words[_RELEASED] = self.seq
        mapped.claims -= 1
        if mapped.closing and mapped.claims == 0:
            mapped._unmap()


class _View:
    """Bytes of a mapped segment as numpy sees them (``__array_interface__``),
    holding the claim: every array made from it keeps it alive."""

    __slots__ = ("__array_interface__", "claim")

    def __init__(self, claim: _Claim, address: int, nbytes: int):
        self.__array_interface__ = {"data": (address, True), "shape": (nbytes,), "typestr": "|u1", "version": 3}
        self.claim = claim


class SegmentMap:
    """A receiving socket's mappings of its senders' segments.

    Mappings are kept for the next message in the same segment; one whose
    sender has retired it or exited is dropped once nothing of it is in use
    (checked at most once a second, as messages arrive), and no more than
    `max_segments` are kept unused.
    """

    def __init__(self, max_segments: int = 64):
        self.max_segments = max_segments
        self._mapped: OrderedDict[str, _Mapped] = OrderedDict()
        self._next_sweep = 0.0
        #: Messages' segments taken (one per segment per message).
        self.taken = 0

    def __len__(self) -> int:
        return len(self._mapped)

    def claim(self, segment: ShmSegment) -> _Claim:
        mapped = self._mapped.get(segment.id)
        if mapped is None or mapped.size != segment.size or mapped.pid != segment.pid:
            self._sweep(adding=True)
            new = _Mapped(segment)
            if mapped is not None:  # not the segment it said it was
                self._mapped.pop(segment.id, None)
                mapped.close()
            mapped = self._mapped[segment.id] = new
        else:
            self._mapped.move_to_end(segment.id)
            self._sweep()
        claim = mapped.claim(segment.seq)
        self.taken += 1
        return claim

    def _sweep(self, *, adding: bool = False) -> None:
        """Drop unused mappings that are stale, and (before adding one) the
        least recently used beyond `max_segments`."""
        now = time.monotonic()
        if not adding and now < self._next_sweep:
            return
        self._next_sweep = now + 1.0
        unused = [key for key, m in self._mapped.items() if m.claims == 0]
        excess = len(self._mapped) + 1 - self.max_segments if adding else 0
        for key in unused:
            mapped = self._mapped[key]
            if excess > 0 or mapped.stale():
                excess -= 1
                del self._mapped[key]
                mapped.close()

    def close(self) -> None:
        """Let go of every mapping (those in use, once their claims end)."""
        for mapped in self._mapped.values():
            mapped.close()
        self._mapped.clear()

"""CPU workers that share the cores: each one's torch threads, and lending idle cores.

On a CPU every worker of a deployment runs on the same cores. Each gets its share of
them, ``cores // N`` torch threads. A decode-only instance's steps are short and
memory-bound, and its cores idle between requests; the instances that encode or
prefill and do not decode (E, P, EP: compute-bound) borrow them. A borrower runs on its
share plus the lent threads only while every instance it borrows from is idle, and on
its share alone while one of them has work, so a lone request is still encoded and
prefilled on every core. The count is picked as each step starts, with the latency model
the step is filled by, and picked again before every layer of the model and every
operation in it (``worker.StepThreads``): a borrower hands the lent threads back within
an operation when a lender gets work, and takes them again when the lender is idle, so a long prefill that
starts while a decode instance has 0.2 s of decodes left borrows its core for the rest.
(Under load a borrower seldom starts a step borrowing: the KV its step hands to a D
instance reaches that instance, through the daemon in about a millisecond, before the
borrower, taking its own new requests first, picks its next step's threads.) The planner's
simulator models both.

Whether an instance has work is a byte in a small block of shared memory (``CoreBoard``,
one byte per instance id) that every CPU worker of the deployment maps: the lender
writes its own byte when its state changes, and a borrower reads its lenders' bytes
before each step and each operation. No message goes through the daemon, so a borrower
sees a lender's new request within one operation of its step.

Plain Python (no torch): the planner's simulator uses ``cpu_threads`` too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger("hydrad.worker")


@dataclass(frozen=True)
class CpuThreads:
    """A CPU instance's torch threads: ``own`` always; ``own + borrow`` while every one of
    ``lenders`` (instance ids, or positions in a list of roles) is idle."""

    own: int
    borrow: int = 0
    lenders: tuple[int, ...] = ()

    def __post_init__(self):
        if self.own < 1 or self.borrow < 0:
            raise ValueError(f"threads: own {self.own} must be >= 1 and borrow {self.borrow} >= 0")
        if self.borrow and not self.lenders:
            raise ValueError("threads to borrow need instances to borrow them from")

    @property
    def most(self) -> int:
        return self.own + self.borrow

    def __str__(self) -> str:
        return f"{self.own}" if not self.borrow else f"{self.own} (+{self.borrow} while idle: {self.lenders})"


def cpu_threads(roles: list[str], cores: int, share: int | None = None) -> list[CpuThreads]:
    """The threads of each instance of ``roles`` when all run on the same ``cores`` CPU cores.

    Each instance's share is ``cores // len(roles)`` (at least 1; ``share`` when given). A
    decode-only instance lends its share; the instances that encode or prefill and do not
    decode borrow the lent threads, split evenly among them (up to ``cores`` each), while
    every decode-only instance is idle. Every other instance has its share."""
    share = share or max(1, cores // max(1, len(roles)))
    lenders = tuple(i for i, role in enumerate(roles) if role == "D")
    borrowers = [i for i, role in enumerate(roles) if "D" not in role]
    extra = share * len(lenders) // len(borrowers) if borrowers else 0
    borrow = max(0, min(extra, cores - share))
    return [CpuThreads(share, borrow, lenders) if i in borrowers and borrow else CpuThreads(share)
            for i in range(len(roles))]


class CoreBoard:
    """One byte per instance id in memory shared with the workers: 1 while it has work.
    Made by the daemon (``new``), handed to each worker when it starts (it pickles only
    while a process is being started), and read and written without locks: each byte has
    one writer."""

    SIZE = 256  # instance ids

    def __init__(self, flags):
        self.flags = flags

    @classmethod
    def new(cls) -> CoreBoard:
        from multiprocessing.sharedctypes import RawArray

        return cls(RawArray("b", cls.SIZE))

    def busy(self, instance_id: int) -> bool:
        return bool(self.flags[instance_id])


class CoreLending:
    """A worker's part in lending cores: it publishes whether it has work, and a borrower
    asks how many threads it may run its next step on."""

    def __init__(self, board: CoreBoard | None, instance_id: int, threads: CpuThreads):
        self.board = board if board is not None and instance_id < CoreBoard.SIZE else None
        self.instance_id = instance_id
        self.threads = self.usable(threads)
        self._busy = False
        if self.board is not None:
            self.board.flags[instance_id] = 0  # a restarted worker starts idle

    def usable(self, threads: CpuThreads) -> CpuThreads:
        """``threads`` as this worker can run them: without a board, nothing is borrowed."""
        return threads if self.board is not None else CpuThreads(threads.own)

    def publish(self, busy: bool) -> None:
        if busy != self._busy and self.board is not None:
            logger.debug("has work: %s", busy)
            self._busy = busy
            self.board.flags[self.instance_id] = int(busy)

    def threads_now(self) -> int:
        t = self.threads
        if not t.borrow or any(self.board.flags[i] for i in t.lenders):
            return t.own
        return t.most

    def set(self, threads: CpuThreads) -> None:
        """The deployment changed: lend and borrow as ``threads`` says from now on."""
        self.threads = self.usable(threads)

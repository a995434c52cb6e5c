"""The checkpoint ledger: per run, the state of every checkpoint.

    committed -> validated -> uploaded (-> pruned by retention)   or  rejected (with the reason)
    any state -> committed: the same step saved again by a later attempt (a new copy, told
    apart by `copy_id`; each copy is judged and uploaded on its own)

One JSON file, `<run_dir>/ledger.json`, mirrored to `runs/<run_id>/ledger.json` in the
store so a new machine can resume from the store alone. Writers (validation and upload
tasks run concurrently) take an exclusive file lock and replace the file atomically. The
two copies are merged both ways (`merge` on reading the store's, `push`), so machines that
take turns training a run each see, and keep, the other's checkpoints.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

from pydantic import BaseModel, Field

from core.files import exclusive_lock, write_atomic
from core.protocol import ResumeSpec, RunDir, copy_id, is_committed, step_of

State = Literal["committed", "validated", "uploaded", "rejected", "pruned"]
RESUMABLE: tuple[State, ...] = ("validated", "uploaded")
log = logging.getLogger(__name__)


class LedgerDamaged(ValueError):
    """The ledger file does not read as a ledger."""


class Transition(BaseModel):
    state: State
    at: float
    note: str = ""


class LedgerEntry(BaseModel):
    step: int
    state: State
    reason: str = ""
    loss: float | None = None
    tokens_seen: int | None = None
    store_url: str | None = None
    copy_id: str | None = Field(None, description="Identity of the copy judged (core.protocol."
                             "copy_id): a later save of the same step is another copy.")
    history: list[Transition] = Field(default_factory=list)
    eval: dict[str, float] = Field(default_factory=dict, description="Scores of this checkpoint's "
                                   "evaluation (storage.manifests.EvalReport.scores), when it had one.")

    def is_about(self, copy: str | None) -> bool:
        """Whether this entry speaks of the copy `copy` (core.protocol.copy_id of the
        directory on disk); an entry from before copies were told apart speaks of any."""
        return self.copy_id is None or self.copy_id == copy


class DataSkip(BaseModel):
    """Global samples [start, end) that training never sees again (the data before a spike)."""

    start: int
    end: int
    reason: str
    at: float


class LedgerData(BaseModel):
    run_id: str
    entries: dict[int, LedgerEntry] = Field(default_factory=dict)
    data_skips: list[DataSkip] = Field(default_factory=list)

    def newest(self, states: tuple[State, ...] = RESUMABLE) -> LedgerEntry | None:
        matching = [e for e in self.entries.values() if e.state in states]
        return max(matching, key=lambda e: e.step) if matching else None

    def steps(self, *states: State) -> list[int]:
        return sorted(s for s, e in self.entries.items() if not states or e.state in states)


class Ledger:
    def __init__(self, run_dir: RunDir | str | Path, run_id: str | None = None):
        run_dir = RunDir.of(run_dir)
        self.path = run_dir.ledger_file
        self.run_id = run_id or run_dir.run_id

    def read(self) -> LedgerData:
        """The ledger; empty when there is none. A damaged file (it is only ever replaced
        whole, so that is the disk's doing or a hand's) raises LedgerDamaged, naming it: every
        reader (the workers' too) sees the same, until `set_aside_if_damaged` repairs it."""
        try:
            return LedgerData.model_validate_json(self.path.read_text())
        except FileNotFoundError:
            return LedgerData(run_id=self.run_id)
        except ValueError as e:  # not JSON, or not a ledger
            raise LedgerDamaged(f"the ledger {self.path} is damaged ({str(e).splitlines()[0]}); "
                                "the next run sets it aside and takes the store's copy") from None

    def set_aside_if_damaged(self) -> Path | None:
        """Move a damaged ledger file aside (under the ledger's lock, so no writer's good copy
        is moved instead); where it went, or None when it reads. The store's copy, merged
        next (restore_ledger), and the checkpoints on disk, judged again, take its place."""
        if not self.path.is_file():
            return None
        with exclusive_lock(self.path.with_suffix(".lock")):
            try:
                self.read()
                return None
            except LedgerDamaged as e:
                aside = self.path.with_name(f"{self.path.name}.damaged-{time.time_ns()}")
                self.path.replace(aside)
                log.warning("%s: set aside as %s", str(e).split("; the next run")[0], aside.name)
                return aside

    @contextmanager
    def edit(self) -> Iterator[LedgerData]:
        """Read-modify-write under an exclusive lock; the change lands atomically or not at all."""
        with exclusive_lock(self.path.with_suffix(".lock")):
            data = self.read()
            yield data
            write_atomic(self.path, data.model_dump_json(indent=2).encode())

    def record(self, step: int, state: State, note: str = "", **fields) -> LedgerEntry:
        """Move checkpoint `step` to `state`. A rejected checkpoint never becomes resumable
        again; only a new save of the same step (the rejected copy was moved aside) starts
        over as committed."""
        with self.edit() as data:
            entry = data.entries.get(step) or LedgerEntry(step=step, state=state)
            if entry.state == "rejected" and state not in ("rejected", "committed"):
                raise ValueError(f"checkpoint step {step} was rejected ({entry.reason}); "
                                 f"it cannot become {state}")
            entry.state = state
            entry.reason = note if state == "rejected" else ""
            if "copy_id" in fields and fields["copy_id"] != entry.copy_id:
                entry.eval = {}  # another copy of the step (saved again): its own scores, later
            for key, value in fields.items():
                setattr(entry, key, value)
            entry.history.append(Transition(state=state, at=time.time(), note=note))
            data.entries[step] = entry
            return entry.model_copy()

    def record_eval(self, step: int, scores: dict[str, float]) -> None:
        """Keep an evaluation's scores with checkpoint `step` (its state does not change)."""
        with self.edit() as data:
            if step in data.entries:
                data.entries[step].eval = dict(scores)

    def add_data_skip(self, start: int, end: int, reason: str) -> DataSkip:
        skip = DataSkip(start=start, end=end, reason=reason, at=time.time())
        with self.edit() as data:
            data.data_skips.append(skip)
        return skip

    def merge(self, raw: bytes) -> None:
        """Take in another copy of this run's ledger (the store's, written by another machine
        that trained the run meanwhile): per step, the entry that changed last wins; data
        skips are the union. Times are each machine's clock: machines that take turns on a
        run must not disagree by more than the time between their turns."""
        with self.edit() as current:
            _merge_into(current, LedgerData.model_validate_json(raw))

    def push(self, store, ours: tuple[int, ...] = ()) -> None:
        """Mirror the ledger to the store, merged with what the store holds (another machine's
        progress is never dropped). Holding the lock keeps an older copy from landing last.
        `ours`: steps whose local entry goes to the store whatever the store's says, however
        late it changed (the caller is about to replace the step's copy in the store)."""
        key = ledger_key(self.run_id)
        with self.edit() as data:
            if store.exists(key):
                _merge_into(data, LedgerData.model_validate_json(store.get_bytes(key)), keep=ours)
            store.put_bytes(key, data.model_dump_json(indent=2).encode())


def _last_change(entry: LedgerEntry) -> float:
    return entry.history[-1].at if entry.history else 0.0


def _merge_into(data: LedgerData, other: LedgerData, keep: tuple[int, ...] = ()) -> None:
    for step, theirs in other.entries.items():
        ours = data.entries.get(step)
        if ours is None or (step not in keep and _last_change(theirs) > _last_change(ours)):
            data.entries[step] = theirs
    known = {(skip.start, skip.end, skip.at) for skip in data.data_skips}
    data.data_skips += [skip for skip in other.data_skips if (skip.start, skip.end, skip.at) not in known]
    data.data_skips.sort(key=lambda skip: skip.at)
    data.entries = dict(sorted(data.entries.items()))


def ledger_key(run_id: str) -> str:
    return f"runs/{run_id}/ledger.json"


def checkpoint_key(run_id: str, step: int) -> str:
    return f"runs/{run_id}/checkpoints/step-{step:08d}"


# -- which checkpoint to resume from -----------------------------------------------------------

@dataclass(frozen=True)
class ResumePoint:
    """A checkpoint to start from: its local copy (`local`), or, where this machine has none,
    the store's (`local` None: the workers read it from the store, each rank only the files
    its part of the state is in)."""

    step: int
    local: Path | None = None

    @property
    def spec(self) -> ResumeSpec:
        return ResumeSpec.directory(self.local) if self.local is not None else ResumeSpec.store(self.step)

    def __str__(self) -> str:
        return self.local.name if self.local is not None else f"step-{self.step:08d} in the store"


def local_copy_judged(run_dir: RunDir, entry: LedgerEntry) -> Path | None:
    """The local copy of `entry`'s step when the entry's verdict is about that very copy (a
    step saved again since is another copy, not judged yet); None otherwise."""
    path = run_dir.checkpoint(entry.step)
    return path if is_committed(path) and entry.is_about(copy_id(path)) else None


def readable_copy(run_dir: RunDir | str | Path, entry: LedgerEntry) -> ResumePoint | None:
    """A copy of a resumable (validated or uploaded) checkpoint this machine can read: its
    local copy where the verdict is about it, else the store's where it was uploaded. A
    checkpoint validated on another machine and not yet uploaded is on that machine's disk
    only: None."""
    if entry.state not in RESUMABLE:
        return None
    local = local_copy_judged(RunDir.of(run_dir), entry)
    if local is not None:
        return ResumePoint(entry.step, local)
    return ResumePoint(entry.step) if entry.state == "uploaded" else None


def choose_resume(run_dir: RunDir | str | Path, ledger: LedgerData) -> ResumePoint | None:
    """The one answer to "which checkpoint": the newest this machine can read a good copy of
    (readable_copy). None: nothing to resume from. The train flow (after judging every
    committed checkpoint), the evaluation and workers restarted in-job all ask it."""
    for entry in sorted(ledger.entries.values(), key=lambda e: -e.step):
        point = readable_copy(run_dir, entry)
        if point is not None:
            return point
    return None


def unsecured_copies(run_dir: RunDir | str | Path, ledger: LedgerData) -> list[int]:
    """Steps of committed local copies that are not in the store yet and not rejected: no
    verdict on them yet, or validated but not uploaded."""
    run_dir = RunDir.of(run_dir)
    steps = []
    for path in run_dir.committed_checkpoints():
        entry = ledger.entries.get(step_of(path))
        if (entry is None or not entry.is_about(copy_id(path))
                or entry.state in ("committed", "validated")):
            steps.append(step_of(path))
    return steps


def unjudged_copies(run_dir: RunDir | str | Path, ledger: LedgerData) -> list[int]:
    """Steps of committed local copies that the ledger has no verdict on yet: never judged,
    or saved again after the copy that was (a rejected copy was moved aside first)."""
    run_dir = RunDir.of(run_dir)
    steps = []
    for path in run_dir.committed_checkpoints():
        entry = ledger.entries.get(step_of(path))
        if entry is None or entry.state in ("committed", "rejected") or not entry.is_about(copy_id(path)):
            steps.append(step_of(path))
    return steps

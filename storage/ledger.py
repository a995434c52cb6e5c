"""The checkpoint ledger: per run, the state of every checkpoint.

    committed -> validated -> uploaded (-> pruned by retention)   or  rejected (with the reason)
    any state -> committed: the same step saved again by a later attempt (a new copy, told
    apart by `copy_id`; each copy is judged and uploaded on its own)

One JSON file, `<run_dir>/ledger.json`, mirrored to `runs/<run_id>/ledger.json` in the
store so a new machine can resume from the store alone. Writers (validation and upload
tasks run concurrently) take an exclusive file lock and replace the file atomically.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Literal

from pydantic import BaseModel, Field

from storage.checksums import exclusive_lock, write_atomic

State = Literal["committed", "validated", "uploaded", "rejected", "pruned"]
RESUMABLE: tuple[State, ...] = ("validated", "uploaded")
LEDGER_FILE = "ledger.json"


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
    copy_id: str | None = Field(None, description="Identity of the copy judged (training.checkpoint."
                             "copy_id): a later save of the same step is another copy.")
    history: list[Transition] = Field(default_factory=list)


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
    def __init__(self, run_dir: str | Path, run_id: str):
        self.path = Path(run_dir) / LEDGER_FILE
        self.run_id = run_id

    def read(self) -> LedgerData:
        if not self.path.is_file():
            return LedgerData(run_id=self.run_id)
        return LedgerData.model_validate_json(self.path.read_text())

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
            for key, value in fields.items():
                setattr(entry, key, value)
            entry.history.append(Transition(state=state, at=time.time(), note=note))
            data.entries[step] = entry
            return entry.model_copy()

    def add_data_skip(self, start: int, end: int, reason: str) -> DataSkip:
        skip = DataSkip(start=start, end=end, reason=reason, at=time.time())
        with self.edit() as data:
            data.data_skips.append(skip)
        return skip

    def replace(self, raw: bytes) -> None:
        """Replace the ledger wholesale (used when restoring it from the store)."""
        data = LedgerData.model_validate_json(raw)
        with self.edit() as current:
            current.entries, current.data_skips = data.entries, data.data_skips

    def push(self, store) -> None:
        """Mirror the ledger to the store. Holding the lock keeps an older copy from landing last."""
        with self.edit() as data:
            store.put_bytes(ledger_key(self.run_id), data.model_dump_json(indent=2).encode())


def ledger_key(run_id: str) -> str:
    return f"runs/{run_id}/{LEDGER_FILE}"


def checkpoint_key(run_id: str, step: int) -> str:
    return f"runs/{run_id}/checkpoints/step-{step:08d}"

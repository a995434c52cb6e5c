"""What happens to a checkpoint after training commits it: validate, upload, prune; and
which one an attempt resumes from.

These functions are the checkpoint lifecycle the Prefect tasks wrap. Any of them may run
concurrently with training and with each other; a per-checkpoint lock makes "validate
step N" happen once, whoever asks first, and the ledger records every verdict.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Callable, Iterator

from core.config import RunConfig, trajectory_conflicts, trajectory_json
from core.cpu_priority import at_background_priority
from core.files import delete_folder_unless_read
from core.protocol import (
    CHECKPOINT_MANIFEST,
    checkpoint_lock,
    copy_id,
    copy_id_of_manifest,
    is_committed,
    set_aside,
    step_of,
)
from goodput.verifier_pool import VerifierCrashed, verify
from storage.ledger import (
    Ledger,
    LedgerData,
    LedgerEntry,
    ResumePoint,
    checkpoint_key,
    choose_resume,
    ledger_key,
    local_copy_judged,
    unjudged_copies,
    unsecured_copies,
)
from storage.manifests import CheckpointManifest, EvalReport, lower_is_better, verify_files
from storage.store import IntegrityError

log = logging.getLogger("goodput.checkpoints")


class CopySuperseded(ValueError):
    """The copy of a step that was validated is no longer on disk: training saved the step
    again since (workers restarted from an older checkpoint re-trained it). The new copy is
    judged and uploaded on its own; the upload of the old one has nothing left to do."""


def ledger_of(config: RunConfig) -> Ledger:
    return Ledger(config.run_dir)


def _step_lock(config: RunConfig, step: int):
    return checkpoint_lock(config.run_dir.checkpoint(step))


def new_checkpoints(config: RunConfig, still_running: Callable[[], bool]) -> Iterator[int]:
    """Yield each checkpoint step as training commits it, until training has ended.

    `still_running` should block for a poll interval. A step saved again (after a rejected
    copy, or by workers restarted from an older checkpoint) is yielded again: it is another
    copy. Copies uploaded before this call are settled and not yielded.
    """
    entries = ledger_of(config).read().entries
    seen = {(step, entry.copy_id) for step, entry in entries.items() if entry.state == "uploaded"}
    while True:
        running = still_running()
        for path in config.run_dir.committed_checkpoints():
            step, copy = step_of(path), copy_id(path)
            # (step, None): uploaded before the ledger told copies apart
            if copy is not None and (step, copy) not in seen and (step, None) not in seen:
                seen.add((step, copy))
                yield step
        if not running:
            return


def unsecured_steps(config: RunConfig) -> list[int]:
    """Committed checkpoints on local disk not yet validated and uploaded (nor rejected):
    those whose tasks could not run, e.g. while the Prefect API was away."""
    return unsecured_copies(config.run_dir, ledger_of(config).read())


def unjudged_steps(config: RunConfig) -> list[int]:
    """Committed checkpoints on local disk that the ledger has no verdict on yet (including
    new saves of a step whose earlier copy was judged)."""
    return unjudged_copies(config.run_dir, ledger_of(config).read())


def verify_timeout_s(config: RunConfig, path: Path) -> float:
    """checkpoint.verify_timeout_s, or by default 600 s plus what reading the checkpoint
    twice (hashing, then loading) takes at a slow 50 MB/s."""
    if config.checkpoint.verify_timeout_s is not None:
        return config.checkpoint.verify_timeout_s
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return 600.0 + 2 * size / 50e6


def held_out_check(config: RunConfig, dataset_dir: Path | None = None, step: int = 1) -> list[str]:
    """The verifier's arguments for the optional held-out loss check (checkpoint.validate_batches)
    of checkpoint `step`, on `dataset_dir`, the dataset the run trains on (found from the
    config when not given). Under a curriculum the mix's held-out loss is weighted as the
    step's training batch was drawn, by the stage in force: the loss it is compared with."""
    if not config.checkpoint.validate_batches:
        return []
    if dataset_dir is None:
        from goodput.data.prepare import dataset_for_training
        from storage.store import store_from_config

        dataset_dir = dataset_for_training(config, store_from_config(config.storage))
    args = ["--dataset", str(dataset_dir),
            "--eval-batches", str(config.checkpoint.validate_batches),
            "--loss-tolerance", str(config.checkpoint.validate_loss_tolerance)]
    if config.data.stages:
        first_sample = (step - 1) * config.global_batch  # the step's batch starts here
        weights = [w for start, w in config.mix_stages() if start <= first_sample][-1]
        args += ["--mix-weights", json.dumps(weights)]
    return args


def validate_checkpoint(config: RunConfig, step: int, dataset_dir: Path | None = None) -> LedgerEntry:
    """committed -> validated, or -> rejected with the reason (the directory is moved aside).
    `dataset_dir`: the run's dataset, for the held-out check (see held_out_check).

    A rejected step whose directory is back was saved again by a later attempt (rejection
    moves the bad copy aside): the new copy is judged on its own.
    """
    ledger = ledger_of(config)
    with _step_lock(config, step):
        entry = ledger.read().entries.get(step)
        path = config.run_dir.checkpoint(step)
        copy = copy_id(path)
        saved_again = entry is not None and entry.state != "committed" and copy is not None \
            and (entry.state == "rejected" or not entry.is_about(copy))
        if entry is not None and entry.state != "committed" and not saved_again:
            return entry  # judged already
        manifest = CheckpointManifest.load(path)
        ledger.record(step, "committed", note=f"saved again after a {entry.state} copy" if saved_again else "",
                      loss=manifest.loss, tokens_seen=manifest.tokens_seen, copy_id=copy)
        conflicts = trajectory_conflicts(manifest.trajectory or {}, trajectory_json(config),
                                         "the checkpoint", "in the run")
        if conflicts:  # e.g. torchrun with other overrides, from scratch
            result = {"ok": False, "reason": (
                f"saved under another data/tokenizer/model/training config than the run's "
                f"({'; '.join(conflicts[:4])}): not this run's trajectory")}
        else:
            result = verify(path, verify_timeout_s(config, path),
                            held_out_check(config, dataset_dir, step))
        if result["ok"]:
            note = f"{result['tensors']} tensors finite"
            if "held_out_loss" in result:
                note += f"; held-out loss {result['held_out_loss']:.4f} (training {result['loss']:.4f})"
            return ledger.record(step, "validated", note=note)
        aside = set_aside(path, "rejected")
        log.warning("checkpoint step %d rejected: %s; kept at %s, never resumed from",
                    step, result["reason"], aside)
        return ledger.record(step, "rejected", note=f"{result['reason']} (kept at {aside})")


def upload_checkpoint(config: RunConfig, step: int, store) -> LedgerEntry:
    """validated -> uploaded: every shard first, the manifest last, then the ledger.

    A stored copy that differs from the manifest's digests because the local file does too
    (damaged on disk since validation) is the local copy's fault, not the store's: the copy
    is set aside (set_aside_damaged), not uploaded again and again."""
    ledger = ledger_of(config)
    with _step_lock(config, step):
        entry = ledger.read().entries.get(step)
        if entry is None or entry.state == "committed":
            raise ValueError(f"checkpoint step {step} is not validated yet; validate it first")
        if entry.state == "rejected":
            return entry  # never to be uploaded
        if entry.state != "uploaded":  # (uploaded: a retry after the push below failed)
            key = checkpoint_key(config.run.run_id, step)
            path = config.run_dir.checkpoint(step)
            copy = copy_id(path)
            if not entry.is_about(copy):
                raise CopySuperseded(f"checkpoint step {step} on disk is not the copy that was "
                                     "validated (it was saved again); validate it first")
            stored = _stored_copy(store, key)
            if stored is not None and (stored[1] == copy or (
                    _uploaded_in_store(config, store, step, stored[1]) and _adoptable(config, path, stored[0]))):
                # This very copy (an earlier try's upload got as far as the manifest), or a
                # newer one of the same trajectory another machine uploaded, which the store's
                # ledger names as the step's uploaded copy: kept, not replaced.
                entry = _adopt(ledger, config, step, store, *stored)
                ledger.push(store)
                return entry
            if stored is not None or entry.store_url:
                # Another copy in the store (older, this machine's saved again since or another
                # machine's; or one the store's ledger does not name as uploaded, e.g. rejected as
                # damaged): the store's ledger stops naming it before it is replaced (this copy's
                # validated entry wins the push, even over a later change of the store's), and
                # its manifest goes first, so that no reader takes the half-replaced step for a
                # whole one or mixes the copies.
                ledger.push(store, ours=(step,))
                store.delete(f"{key}/{CHECKPOINT_MANIFEST}")
            # The manifest's digests spare hashing every shard before it goes out; the store checks them.
            known = {f.path: f.sha256 for f in CheckpointManifest.load(path).files}
            # Training runs meanwhile: the upload (its transfer threads included) takes the
            # cycles training leaves idle (core.cpu_priority).
            try:
                # The step's folder has one writer (this upload, under the step's lock and the
                # run's lease): what a killed earlier upload left unfinished there is aborted.
                at_background_priority(store.upload_dir, path, key, last=(CHECKPOINT_MANIFEST,),
                                       known_sha256=known, abort_unfinished=True)
            except IntegrityError:
                damaged = at_background_priority(verify_files, path, CheckpointManifest.load(path).files)
                if not damaged:  # the transfer's or the store's doing: the task retries
                    raise
                # Still under the step's lock: the copy set aside is the one just checked.
                return _set_aside_local(ledger, config, step, entry, "; ".join(damaged[:3]))
            entry = ledger.record(step, "uploaded", store_url=store.url(key), copy_id=copy)
    # Every time, so that the store's ledger (what a new machine resumes from) names this step.
    ledger.push(store)
    return entry


def secure_checkpoint(config: RunConfig, step: int, store) -> LedgerEntry:
    """committed -> validated -> uploaded in one go, outside the train flow (whose tasks do
    each on its own thread): what Ctrl-C's stopped training left (flows.cli). Its entry:
    uploaded, or rejected with the reason."""
    entry = validate_checkpoint(config, step)
    return upload_checkpoint(config, step, store) if entry.state == "validated" else entry


def secured_text(step: int, entry: LedgerEntry) -> str:
    """How securing a checkpoint outside the train flow's tasks ended (secure_checkpoint's
    entry), as the command after Ctrl-C and the flow after a cancellation say it."""
    return f"checkpoint step {step} " + (
        f"validated and uploaded to {entry.store_url}" if entry.state == "uploaded"
        else f"{entry.state}: {entry.reason}")


def restore_ledger(config: RunConfig, store) -> None:
    """Merge the store's copy of the ledger into the local one: a new machine starts from
    it, and a machine that trained the run before learns what others did since (without it
    it would resume from its own older checkpoint and upload over theirs).

    A local ledger that no longer reads is set aside first (Ledger.set_aside_if_damaged).
    With a local ledger to go on, a store that cannot be read right now is reported and
    skipped; without one it is an error, as nothing could be resumed or evaluated."""
    ledger, key = ledger_of(config), ledger_key(config.run.run_id)
    ledger.set_aside_if_damaged()
    try:
        if not store.exists(key):
            return
        ledger.merge(store.get_bytes(key))
    except (ConnectionError, TimeoutError, PermissionError) as e:
        if not ledger.path.is_file():
            raise
        log.warning("could not read the ledger of run %s from the store (%s); going on with "
                    "the local ledger", config.run.run_id, e)
        return
    try:
        adopt_uploaded_copies(config, store)
    except Exception as e:  # the store gone meanwhile, a stored manifest that does not read, ...
        # Never stops a resume: a local copy not adopted is judged and uploaded on its own
        # (upload_checkpoint adopts the store's copy then, where it still may).
        log.warning("could not adopt the copies of run %s's checkpoints the store's ledger names "
                    "(%s: %s); going on with the local copies", config.run.run_id,
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")


def adopt_uploaded_copies(config: RunConfig, store) -> list[int]:
    """Steps whose local copy gave way to the store's: a copy another machine uploaded of a
    step this machine also saved, before it (this machine died before uploading its own, the
    other resumed from an older checkpoint and got there too). The store's copy, of the same
    trajectory and newer, is the step's (it is what the other machine trained on from); the
    local one is moved aside ("superseded"), not judged and uploaded over it. A local copy
    newer than the store's (saved again here since) stays, to be judged and uploaded."""
    ledger = ledger_of(config)
    adopted = []
    for path in config.run_dir.committed_checkpoints():
        step = step_of(path)
        entry = ledger.read().entries.get(step)
        if entry is None or entry.state != "uploaded" or entry.is_about(copy_id(path)):
            continue
        key = checkpoint_key(config.run.run_id, step)
        with _step_lock(config, step):
            stored = _stored_copy(store, key)
            entry = ledger.read().entries.get(step)
            if (stored is None or entry is None or entry.state != "uploaded"
                    or entry.copy_id != stored[1] or not _adoptable(config, path, stored[0])):
                continue
            _adopt(ledger, config, step, store, *stored)
            adopted.append(step)
    return adopted


def _stored_copy(store, key: str) -> tuple[CheckpointManifest, str] | None:
    """The manifest of the copy of a checkpoint the store holds under `key`, and its copy id
    (core.protocol.copy_id: the manifest is uploaded as it is on disk); None: no whole copy
    (none at all, or a manifest that does not read as one: replaceable, never adopted)."""
    try:
        raw = store.get_bytes(f"{key}/{CHECKPOINT_MANIFEST}")
    except FileNotFoundError:
        return None
    try:
        return CheckpointManifest.model_validate_json(raw), copy_id_of_manifest(raw)
    except ValueError as e:
        log.warning("%s/%s in the store is not a checkpoint manifest (%s): that copy is "
                    "replaced, not adopted", key, CHECKPOINT_MANIFEST, str(e).splitlines()[0])
        return None


def _uploaded_in_store(config: RunConfig, store, step: int, stored_copy: str) -> bool:
    """The store's ledger calls `stored_copy` the step's uploaded copy (as adopt_uploaded_copies
    requires of the merged ledger): a stored copy it does not name (rejected as damaged since,
    or never recorded) is replaceable, never adopted."""
    try:
        raw = store.get_bytes(ledger_key(config.run.run_id))
    except FileNotFoundError:
        return False
    entry = LedgerData.model_validate_json(raw).entries.get(step)
    return entry is not None and entry.state == "uploaded" and entry.copy_id == stored_copy


def _adoptable(config: RunConfig, path: Path, stored: CheckpointManifest) -> bool:
    """The store's copy of the step of the local copy at `path` is of the run's trajectory
    and was saved after the local copy (by another machine; clocks agree as the ledger's
    merge assumes)."""
    local = CheckpointManifest.load(path)
    return (stored.step == local.step and stored.created_at > local.created_at
            and not trajectory_conflicts(stored.trajectory or {}, trajectory_json(config),
                                         "the store's copy", "in the run"))


def _adopt(ledger: Ledger, config: RunConfig, step: int, store, stored: CheckpointManifest,
           stored_copy: str) -> LedgerEntry:
    """The store's copy `stored_copy` becomes the step's uploaded copy in the ledger; a
    different local copy is moved aside (never deleted). Under the step's lock."""
    path = config.run_dir.checkpoint(step)
    local = copy_id(path)
    note = f"the store's copy {stored_copy} adopted"
    if local == stored_copy:
        note = "already in the store (an earlier upload of this copy got as far as its manifest)"
    elif local is not None:
        aside = set_aside(path, "superseded")
        note += f"; this machine's copy {local}, saved before it, moved to {aside}"
    return ledger.record(step, "uploaded", note=note, copy_id=stored_copy,
                         store_url=store.url(checkpoint_key(config.run.run_id, step)),
                         loss=stored.loss, tokens_seen=stored.tokens_seen)


def run_finished(config: RunConfig, store) -> bool:
    """The newest checkpoint this machine can resume from (choose_resume; the local ledger
    merged with the store's) reached training.max_steps."""
    try:
        restore_ledger(config, store)
    except Exception as e:  # e.g. serving must not depend on the store being up right now
        log.warning("could not read the ledger of run %s from the store (%s); judging from the "
                    "local ledger only", config.run.run_id, e)
    point = choose_resume(config.run_dir, ledger_of(config).read())
    return point is not None and point.step >= config.training.max_steps


def resume_point(config: RunConfig, store) -> ResumePoint | None:
    """Where the next attempt starts (storage.ledger.choose_resume), once the committed
    checkpoints on local disk newer than the newest validated one are judged, newest first,
    up to the first that passes: progress saved just before a crash counts, and a backlog of
    older unjudged ones (a flow process killed while its validations lagged) is left to the
    flow's own tasks. A verifier that gives no verdict leaves its checkpoint unjudged: not
    resumed from."""
    restore_ledger(config, store)
    newest = ledger_of(config).read().newest()
    for step in sorted(unjudged_steps(config), reverse=True):
        if newest is not None and step <= newest.step:
            break
        # Said: on a busy machine the verdict (at background priority) took over a minute,
        # and the log said nothing between the failure and the next attempt.
        log.info("judging checkpoint step %d before resuming: the next attempt starts from it "
                 "if it is whole", step)
        judging = time.monotonic()
        try:
            entry = validate_checkpoint(config, step)
        except VerifierCrashed as e:
            log.warning("%s; not resuming from it", e)
            continue
        log.info("checkpoint step %d %s in %.0f s", step, entry.state, time.monotonic() - judging)
        if entry.state == "validated":
            break
    return choose_resume(config.run_dir, ledger_of(config).read())


def resume_position(config: RunConfig, point: ResumePoint | None, store) -> int:
    """The global sample the data loader continues from at `point` (0: from scratch)."""
    if point is None:
        return 0
    if point.local is not None:
        return CheckpointManifest.load(point.local).data_position
    key = f"{checkpoint_key(config.run.run_id, point.step)}/{CHECKPOINT_MANIFEST}"
    return CheckpointManifest.model_validate_json(store.get_bytes(key)).data_position


def set_aside_damaged(config: RunConfig, step: int, from_store: bool, reason: str) -> LedgerEntry:
    """A worker found checkpoint `step` damaged when loading it (a file no longer matches
    the manifest it was validated with). The damaged local copy is moved aside; when the
    store holds a good copy the checkpoint stays resumable from there, else it is rejected.
    Either way the next attempt never loads the damaged copy."""
    ledger = ledger_of(config)
    with _step_lock(config, step):
        entry = ledger.read().entries.get(step)
        if from_store:
            shutil.rmtree(config.run_dir.fetched_from_store(step), ignore_errors=True)
            log.warning("checkpoint step %d rejected: its copy in the store is damaged (%s); "
                        "never resumed from", step, reason)
            return ledger.record(step, "rejected", note=f"store copy damaged: {reason}")
        return _set_aside_local(ledger, config, step, entry, reason)


def _set_aside_local(ledger, config: RunConfig, step: int, entry: LedgerEntry | None,
                     reason: str) -> LedgerEntry:
    """set_aside_damaged's local case, under the step's lock (held by the caller)."""
    aside = set_aside(config.run_dir.checkpoint(step), "rejected")
    if entry is not None and entry.state == "uploaded":
        log.warning("checkpoint step %d: the local copy is damaged since validation (%s), moved "
                    "to %s; the store's copy serves", step, reason, aside)
        return ledger.record(step, "uploaded", note=f"local copy damaged ({reason}), moved to "
                                                    f"{aside}; resuming from the store copy")
    log.warning("checkpoint step %d rejected: damaged since validation (%s); kept at %s, never "
                "resumed from", step, reason, aside)
    return ledger.record(step, "rejected", note=f"damaged since validation: {reason} (kept at {aside})")


def prune_local(config: RunConfig) -> list[int]:
    """Keep the newest `checkpoint.keep_local` local checkpoints; delete older *uploaded* ones.

    A checkpoint that is not safely in the store is never deleted, nor is the newest
    resumable one. Deletions are noted in the ledger history.
    """
    ledger = ledger_of(config)
    entries = ledger.read().entries
    newest = ledger.read().newest()
    local = [step_of(p) for p in config.run_dir.committed_checkpoints()]
    deleted = []
    for step in local[:-config.checkpoint.keep_local]:
        entry = entries.get(step)
        if entry is None or entry.state != "uploaded" or (newest and newest.step == step):
            continue
        if local_copy_judged(config.run_dir, entry) is None:
            continue  # a newer copy than the one in the store, not judged yet
        with _step_lock(config, step):
            if not is_committed(config.run_dir.checkpoint(step)):
                continue  # pruned meanwhile by another flow's retention
            shutil.rmtree(config.run_dir.checkpoint(step))
        ledger.record(step, "uploaded", note="local copy pruned; store copy kept")
        deleted.append(step)
    prune_fetched(config)
    return deleted


def prune_fetched(config: RunConfig) -> list[int]:
    """Files fetched from the store (RunDir.fetched_from_store: to resume from, or the
    weights an evaluation read): a step's are deleted once a newer checkpoint is on local
    disk (nothing resumes from them then), and beyond the newest `checkpoint.keep_local`
    steps fetched (a machine that only evaluates would otherwise keep every step's weights).
    A step's files that a resume or an evaluation is reading (core.files.reading_folder) are
    left for a later call. Returns the steps whose files were deleted."""
    local = [step_of(p) for p in config.run_dir.committed_checkpoints()]
    fetched = sorted(step_of(cache) for cache in
                     config.run_dir.fetched_from_store(0).parent.glob("step-*"))
    older = {step for step in fetched if local and step < local[-1]}
    beyond = set(fetched[:-config.checkpoint.keep_local])
    return [step for step in sorted(older | beyond)
            if delete_folder_unless_read(config.run_dir.fetched_from_store(step))]


def prune_aside(config: RunConfig) -> list[str]:
    """Copies moved aside beyond the newest `checkpoint.keep_aside` of each kind (rejected,
    superseded): deleted, so that a run with many rollbacks does not fill its disk."""
    deleted = []
    for kind in ("rejected", "superseded"):
        folder = config.run_dir.aside(kind)
        # Named step-<step>-<time_ns moved>: oldest first by the time they were moved.
        copies = sorted(folder.glob("step-*-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
        for old in copies[:max(0, len(copies) - config.checkpoint.keep_aside)]:
            shutil.rmtree(old, ignore_errors=True)
            deleted.append(f"{kind}/{old.name}")
    return deleted


def prune_store(config: RunConfig, store) -> list[int]:
    """Store retention (checkpoint.store_keep_every): keep every M-th step, the best by eval
    loss and the newest validated; delete the rest from the store (manifest first, so a
    half-deleted checkpoint is never taken for a whole one) and mark them pruned.

    A step the local tier still holds (one of the newest checkpoint.keep_local) keeps its
    store copy until prune_local has deleted the local one: the two tiers' retention never
    shrink each other, and a pruned step is gone from both."""
    keep_every = config.checkpoint.store_keep_every
    if keep_every is None:
        return []
    ledger = ledger_of(config)
    data = ledger.read()
    newest = data.newest()
    keep = {s for s in data.steps("uploaded") if s % keep_every == 0}
    keep |= {newest.step} if newest else set()
    best = best_by_eval(config)
    keep |= {best} if best is not None else set()
    pruned = []
    for step in data.steps("uploaded"):
        if step in keep:
            continue
        with _step_lock(config, step):
            if is_committed(config.run_dir.checkpoint(step)):
                continue  # kept locally: later, once its local copy is pruned
            key = checkpoint_key(config.run.run_id, step)
            store.delete(f"{key}/{CHECKPOINT_MANIFEST}")
            store.delete_prefix(key)
            shutil.rmtree(config.run_dir.checkpoint(step), ignore_errors=True)  # debris, if any
        ledger.record(step, "pruned", note=f"retention: not a multiple of {keep_every}, "
                                           "not the best by eval, not the newest")
        pruned.append(step)
    if pruned:
        ledger.push(store)
    return pruned


def eval_history(config: RunConfig) -> list[EvalReport]:
    """The reports of this run's checkpoints with the current eval settings, by step; a
    report of a copy the ledger no longer holds (the step was saved again) is left out."""
    directory = config.run_dir.eval_dir
    reports = [EvalReport.model_validate_json(p.read_text())
               for p in sorted(directory.glob("step-*.json"))] if directory.is_dir() else []
    entries = Ledger(config.run_dir).read().entries
    return [r for r in reports if r.eval_hash == config.eval_hash()
            and (r.step not in entries or entries[r.step].copy_id in (None, r.copy_id))]


_said_no_such_score: set[tuple[str, str]] = set()  # once per process: retention asks often


def best_by_eval(config: RunConfig) -> int | None:
    """The step whose report is best by eval.best_metric, among the reports made with the
    current eval settings (reports made otherwise are not compared with them)."""
    metric = config.eval.best_metric
    history = eval_history(config)
    reports = [r for r in history if metric in r.scores()]
    if not reports:
        if history and (config.run.run_id, metric) not in _said_no_such_score:
            # A metric name lm-eval's tasks do not report (a typo of the part after the task)
            # shows only here, once reports exist: retention then keeps no best checkpoint.
            _said_no_such_score.add((config.run.run_id, metric))
            log.warning("eval.best_metric=%s is a score no report of run '%s' has (they have: "
                        "%s): retention keeps no checkpoint as the best by eval; set it to one "
                        "of those", metric, config.run.run_id, ", ".join(sorted(history[-1].scores())))
        return None
    scored = {r.step: r.scores()[metric] for r in reports}
    return (min if lower_is_better(metric, reports) else max)(scored, key=scored.get)


def apply_retention(config: RunConfig, store) -> dict[str, list]:
    return {"local": prune_local(config), "store": prune_store(config, store),
            "aside": prune_aside(config)}

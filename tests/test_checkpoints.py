"""Checkpoints from real torchrun training: commit, validate, reject, upload, resume."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from core.protocol import FailureClass, copy_id, is_committed, set_aside
from goodput import checkpoint_lifecycle as checkpoints
from goodput.runs import train_attempt
from infra.torchrun import TrainingFailed
from storage import open_store
from storage.ledger import checkpoint_key
from storage.manifests import CheckpointManifest, list_files, verify_files
from storage.store import store_from_config
from tests.helpers import (
    REPO,
    flip_bytes,
    losses_by_step,
    small_config,
    synthetic_dataset,
    thread_nice,
    torchrun_training,
)
from training.checkpoint.errors import CheckpointCorrupt
from training.checkpoint.reader import StoreReader, VerifiedReader, load_all_tensors
from training.checkpoint.verify import verify_checkpoint
from training.metrics import read_metrics


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run trained to step 20 with plain torchrun, checkpoints at 10 and 20."""
    root = tmp_path_factory.mktemp("trained")
    dataset = synthetic_dataset(root / "dataset")
    config = small_config(root, "training.max_steps=20", "model.max_seq_len=64")
    proc = torchrun_training(config, dataset)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root, dataset


@pytest.fixture
def run(trained, tmp_path):
    """A private copy of the trained run, free to damage."""
    root, dataset = trained
    shutil.copytree(root / "runs", tmp_path / "runs")
    return small_config(tmp_path, "training.max_steps=20"), dataset


def test_training_commits_checkpoints_that_verify(run):
    config, _ = run
    committed = config.run_dir.committed_checkpoints()
    assert [p.name for p in committed] == ["step-00000010", "step-00000020"]
    manifest = CheckpointManifest.load(committed[-1])
    assert manifest.step == 20 and manifest.world_size == 2
    assert manifest.seq_len == config.training.seq_len  # what the held-out check evaluates at
    assert (manifest.dataset_id, manifest.eos_id) == ("synthetic", 0)  # export writes the eos id
    assert ".metadata" in {f.path for f in manifest.files}
    result = verify_checkpoint(committed[-1])
    assert result["ok"], result
    assert checkpoints.validate_checkpoint(config, 20).state == "validated"


def test_rerunning_a_finished_run_says_there_is_nothing_to_train(run):
    config, dataset = run
    proc = torchrun_training(config, dataset, resume="auto")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "step 20 is training.max_steps: nothing to train (a longer run is another run.run_id" in out
    assert "done: step 20 (no step to train)" in out and "loss nan" not in out


def test_a_checkpoint_without_manifest_is_never_resumed_and_data_prepared_anew_is_said(run, tmp_path):
    """Step 20 lost its manifest (killed mid-commit): never resumed, by the launch task's
    resume point or by plain torchrun's --resume auto, and saving step 20 again clears the
    debris. The same config can prepare other data (changed sources or tokenizer files): the
    run resumes on it, and the log says which dataset and end-of-document token it left."""
    from storage.manifests import DatasetManifest

    config, dataset = run
    (config.run_dir.checkpoint(20) / "manifest.json").unlink()  # killed mid-commit
    assert [p.name for p in config.run_dir.committed_checkpoints()] == ["step-00000010"]
    store = open_store(str(tmp_path / "store"))
    assert checkpoints.resume_point(config, store).local == config.run_dir.checkpoint(10)
    reprepared = shutil.copytree(dataset, tmp_path / "reprepared")
    manifest = DatasetManifest.load(reprepared)
    manifest.dataset_id, manifest.eos_id = "reprepared", 1
    manifest.save(reprepared)
    proc = torchrun_training(config, reprepared, resume="auto")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from" in proc.stdout and "step-00000010" in proc.stdout
    assert "in-job restart" not in proc.stdout  # a second plain run is no restart of the first
    assert verify_checkpoint(config.run_dir.checkpoint(20))["ok"]
    assert re.search(r"step-00000010 was trained on dataset synthetic; this attempt reads dataset "
                     r"reprepared, whose documents end with token 1 where the checkpoint's ended "
                     r"with 0 .* continues at sample \d+ of the new data", proc.stdout + proc.stderr)
    resumed = CheckpointManifest.load(config.run_dir.checkpoint(20))
    assert (resumed.dataset_id, resumed.eos_id) == ("reprepared", 1)


def test_torchrun_with_overrides_that_change_the_trajectory_does_not_continue_the_run(run):
    """The path users debug by (torchrun on the run's config, overrides on the command line)
    cannot stretch a run's schedule: a checkpoint saved under another trajectory config is
    not resumed, with the fields that differ and what to do, and nothing is written."""
    from infra.torchrun import free_port

    config, dataset = run
    saved = sorted(p.name for p in config.run_dir.checkpoints.iterdir())
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "training", "--config",
         str(config.run_dir.config_file), "--dataset", str(dataset), "--resume", "auto",
         "training.max_steps=30"],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"exitcode  : {FailureClass.CONFIG.exit_code} " in out, out[-3000:]
    assert re.search(r"step-00000020 was saved under another data/tokenizer/model/training config "
                     r"than this one \(training.max_steps: 20 in the checkpoint, 30 here\).*Continue the "
                     r"run with its own config \(--config \S+config.yaml", out), out[-3000:]
    assert sorted(p.name for p in config.run_dir.checkpoints.iterdir()) == saved


def test_resuming_on_data_of_another_tokenizer_is_refused(run, tmp_path):
    """A corpus that changed under a run has its tokenizer trained again: the checkpoint's
    embeddings would be read by other token ids. The resume is refused (a config error, never
    retried) with what to do, and nothing is written over."""
    from storage.manifests import DatasetManifest

    config, dataset = run
    trained_with = CheckpointManifest.load(config.run_dir.checkpoint(20))
    trained_with.tokenizer_sha256 = "1" * 64  # the synthetic dataset names no tokenizer
    trained_with.save(config.run_dir.checkpoint(20))
    retokenized = shutil.copytree(dataset, tmp_path / "retokenized")
    manifest = DatasetManifest.load(retokenized)
    manifest.dataset_id, manifest.tokenizer_sha256 = "retokenized", "0" * 64
    manifest.save(retokenized)
    saved = sorted(p.name for p in config.run_dir.checkpoints.iterdir())
    proc = torchrun_training(config, retokenized, resume="auto")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"exitcode  : {FailureClass.CONFIG.exit_code} " in out, out[-3000:]
    assert re.search(r"step-00000020 was trained on dataset synthetic, whose tokenizer \(sha256 "
                     r"111111111111\) is not this attempt's dataset retokenized's \(000000000000\)"
                     r".*restore them, or train the new data under a new run.run_id", out)
    assert sorted(p.name for p in config.run_dir.checkpoints.iterdir()) == saved
    assert CheckpointManifest.load(config.run_dir.checkpoint(20)) == trained_with


def test_a_checkpoint_of_another_trajectory_is_rejected_and_kept_aside(run):
    """Saved into the run's directory under another config (torchrun with other overrides,
    from scratch): the orchestrator does not adopt it; it is kept aside, as any rejected copy."""
    config, _ = run
    manifest = CheckpointManifest.load(config.run_dir.checkpoint(20))
    assert manifest.trajectory["training"]["max_steps"] == 20
    manifest.trajectory["training"]["max_steps"] = 30
    manifest.trajectory["training"]["a_field_newer_code_added"] = 1  # no conflict: only one has it
    manifest.save(config.run_dir.checkpoint(20))
    entry = checkpoints.validate_checkpoint(config, 20)
    assert entry.state == "rejected"
    assert ("saved under another data/tokenizer/model/training config than the run's "
            "(training.max_steps: 30 in the checkpoint, 20 in the run)") in entry.reason
    assert not config.run_dir.checkpoint(20).exists()
    assert list((config.run_dir / "checkpoints" / "rejected").glob("step-00000020-*"))


def test_flipped_byte_is_rejected_and_kept_aside(run, tmp_path, caplog):
    config, _ = run
    shard = next(config.run_dir.checkpoint(20).glob("*.distcp"))
    flip_bytes(shard)
    with caplog.at_level("WARNING", logger="goodput.checkpoints"):
        entry = checkpoints.validate_checkpoint(config, 20)
    assert entry.state == "rejected"
    # Said, not only written in the ledger: a resume from an older step says why.
    assert "checkpoint step 20 rejected: checksum" in caplog.text and "never resumed from" in caplog.text
    assert "sha256" in entry.reason and shard.name in entry.reason
    assert not config.run_dir.checkpoint(20).exists()
    assert list((config.run_dir / "checkpoints" / "rejected").glob("step-00000020-*"))
    store = open_store(str(tmp_path / "store"))
    assert checkpoints.resume_point(config, store).local == config.run_dir.checkpoint(10)
    with pytest.raises(ValueError, match="rejected"):
        checkpoints.ledger_of(config).record(20, "validated")


def test_missing_shard_and_non_finite_weights_are_rejected(run):
    config, _ = run
    next(config.run_dir.checkpoint(10).glob("*.distcp")).unlink()
    assert "missing file" in checkpoints.validate_checkpoint(config, 10).reason

    # Checksums that match, weights that do not: what a diverged run would save.
    path = config.run_dir.checkpoint(20)
    manifest = CheckpointManifest.load(path)
    state = load_all_tensors(path)
    state["model.norm.weight"][0] = float("nan")
    shutil.rmtree(path)
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    manifest.files = list_files(path, exclude=("manifest.json",))
    manifest.save(path)
    entry = checkpoints.validate_checkpoint(config, 20)
    assert entry.state == "rejected" and "non-finite" in entry.reason and "norm.weight" in entry.reason


def test_held_out_loss_check_rejects_finite_but_wrong_weights(run):
    config, dataset = run
    path = config.run_dir.checkpoint(20)
    good = verify_checkpoint(path, dataset, eval_batches=2)
    assert good["ok"] and good["held_out_loss"] < good["loss"] * 1.5

    # Every value finite and every checksum right, but the embedding rows are shuffled:
    # what a bad reshard or a write from the wrong buffer would leave.
    manifest = CheckpointManifest.load(path)
    state = load_all_tensors(path)
    embedding = state["model.tok_embeddings.weight"]
    state["model.tok_embeddings.weight"] = embedding[torch.randperm(embedding.shape[0],
                                                     generator=torch.Generator().manual_seed(0))]
    shutil.rmtree(path)
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    manifest.files = list_files(path, exclude=("manifest.json",))
    manifest.save(path)
    assert verify_checkpoint(path)["ok"]  # the structural checks cannot tell
    bad = verify_checkpoint(path, dataset, eval_batches=2)
    assert not bad["ok"] and "held-out loss" in bad["reason"] and "validate_loss_tolerance" in bad["reason"]


def test_a_verifier_that_ends_without_a_verdict_leaves_the_checkpoint_unjudged(run, monkeypatch):
    """The held-out check's dataset is gone: the verifier crashes in its own setup. That is no
    verdict on the checkpoint (nor is being killed for memory): it stays committed, in place,
    for the task's retry, and is judged once the verifier can run."""
    config, dataset = run
    missing = ["--dataset", str(dataset.parent / "gone"), "--eval-batches", "2"]
    monkeypatch.setattr(checkpoints, "held_out_check", lambda config, dataset_dir=None, step=1: missing)
    with pytest.raises(checkpoints.VerifierCrashed, match=r"step-00000020 ended without a verdict"):
        checkpoints.validate_checkpoint(config, 20)
    assert checkpoints.ledger_of(config).read().entries[20].state == "committed"
    assert checkpoints.unjudged_steps(config) == [10, 20]
    assert config.run_dir.checkpoint(20).is_dir()
    verdict = checkpoints.verify(config.run_dir.checkpoint(20), held_out=[
        "--dataset", str(dataset), "--eval-batches", "2"])
    assert verdict["ok"], verdict


def test_one_verifier_process_judges_checkpoint_after_checkpoint(run, tmp_path, monkeypatch):
    """A flow keeps its verifier between checkpoints (importing torch is most of a verifier's
    work on a small model); each judgement reads its checkpoint anew: a copy damaged after the
    first verdict is rejected by the same process. Relative paths mean what they mean where
    the request is made, and one that crashes is replaced, not asked again."""
    from goodput import verifier_pool

    config, dataset = run
    first = checkpoints.verify(config.run_dir.checkpoint(10))
    server = verifier_pool._idle[-1].process
    # Out of the terminal's process group: a Ctrl-C that stops training leaves it judging.
    assert os.getpgid(server.pid) != os.getpgid(0)
    monkeypatch.chdir(config.run_dir.checkpoint(20).parent)
    assert checkpoints.verify(os.path.relpath(config.run_dir.checkpoint(20)))["ok"]
    flip_bytes(next(p for p in config.run_dir.checkpoint(10).iterdir() if p.suffix == ".distcp"))
    second = checkpoints.verify(config.run_dir.checkpoint(10))
    assert first["ok"] and not second["ok"] and second["reason"].startswith("checksum")
    assert verifier_pool._idle[-1].process is server and server.poll() is None
    with pytest.raises(checkpoints.VerifierCrashed, match="ended without a verdict"):
        checkpoints.verify(config.run_dir.checkpoint(20), held_out=[
            "--dataset", str(tmp_path / "gone"), "--eval-batches", "2"])
    assert server.wait(10) != 0 and server not in [v.process for v in verifier_pool._idle]
    assert checkpoints.verify(config.run_dir.checkpoint(20), held_out=[
        "--dataset", str(dataset), "--eval-batches", "2"])["ok"]


def test_an_unjudged_checkpoint_is_not_resumed_from(run, tmp_path, monkeypatch):
    """Before an attempt, every committed checkpoint is judged; one whose verifier gives no
    verdict is passed over (not resumed from, not a failure): the attempt starts from the
    newest judged one."""
    config, _ = run
    store = open_store(str(tmp_path / "store"))
    checkpoints.validate_checkpoint(config, 10)

    def no_verdict(path, *args, **kwargs):
        raise checkpoints.VerifierCrashed(f"the verifier of {path} was killed for memory")

    monkeypatch.setattr(checkpoints, "verify", no_verdict)
    point = checkpoints.resume_point(config, store)
    assert point.step == 10 and checkpoints.unjudged_steps(config) == [20]


def test_the_verifier_holds_a_bounded_share_of_a_checkpoint_larger_than_its_memory(tmp_path):
    """A checkpoint of about 590 MB (a 49M-parameter model with its AdamW moments) validates
    in a process whose data segment may not grow by more than 200 MB beyond what importing
    torch takes; loading it whole, as the verifier once did, fails under the same limit."""
    import resource
    import subprocess

    from training.model import ModelArgs, Transformer

    args = ModelArgs(vocab_size=4096, dim=768, n_layers=6, n_heads=12, max_seq_len=64)
    model = Transformer(args, seed=0)
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    for k, v in model.state_dict().items():
        state[f"optim.state.{k}.exp_avg"] = torch.full_like(v, 1e-3)
        state[f"optim.state.{k}.exp_avg_sq"] = torch.full_like(v, 1e-6)
    state["progress"] = {"step": 10, "tokens_seen": 0}
    n_tensors = len(state) - 1
    path = tmp_path / "step-00000010"
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    del model, state
    CheckpointManifest(step=10, tokens_seen=0, files=list_files(path), world_size=1, layout={},
                       config_hash="", dataset_id="", model_args=vars(args), created_at=0, loss=2.0
                       ).save(path)
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size > 550e6

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    probe = subprocess.run([sys.executable, "-c", "import torch.distributed.checkpoint, "
                            "training.checkpoint.verify; print(next(l.split()[1] for l in "
                            "open('/proc/self/status') if l.startswith('VmData')))"],
                           capture_output=True, text=True, env=env, check=True)
    limit = int(probe.stdout) * 1024 + 200 * 2**20
    assert limit < size

    def limited(*command: str) -> subprocess.CompletedProcess:
        def set_limit():
            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        return subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env,
                              preexec_fn=set_limit, timeout=300)

    verdict = limited("-m", "training.checkpoint.verify", str(path), "--max-bytes", str(32 * 2**20))
    assert verdict.returncode == 0, verdict.stdout + verdict.stderr[-2000:]
    result = json.loads(verdict.stdout.splitlines()[-1])
    assert result["ok"] and result["tensors"] == n_tensors
    whole = limited("-c", f"from training.checkpoint.reader import load_all_tensors; "
                          f"load_all_tensors({str(path)!r})")
    assert whole.returncode != 0 and "memory" in (whole.stderr + whole.stdout).lower()


def test_a_retried_upload_pushes_the_ledger_the_failed_try_could_not(run, tmp_path, monkeypatch):
    config, _ = run
    store = open_store(str(tmp_path / "store"))
    checkpoints.validate_checkpoint(config, 20)

    def store_gone(self, store):
        raise ConnectionError("the store went away after the upload")

    with monkeypatch.context() as patched:
        patched.setattr(checkpoints.Ledger, "push", store_gone)
        with pytest.raises(ConnectionError):
            checkpoints.upload_checkpoint(config, 20, store)
    assert not store.exists("runs/test/ledger.json")
    assert checkpoints.upload_checkpoint(config, 20, store).state == "uploaded"  # the retry
    assert json.loads(store.get_bytes("runs/test/ledger.json"))["entries"]["20"]["state"] == "uploaded"


def test_a_checkpoint_damaged_on_disk_after_validation_is_set_aside_not_uploaded(run, tmp_path, caplog):
    """Its upload finds the stored copy differing from the manifest's digests: the local file
    does too, so the local copy is to blame (the error named the store's copy, and the task
    uploaded it three more times): it is set aside and rejected, and nothing is retried."""
    config, _ = run
    store = open_store(str(tmp_path / "store"))
    assert checkpoints.validate_checkpoint(config, 20).state == "validated"
    shard = next(config.run_dir.checkpoint(20).glob("*.distcp"))
    flip_bytes(shard)
    with caplog.at_level("WARNING", logger="goodput.checkpoints"):
        entry = checkpoints.upload_checkpoint(config, 20, store)
    assert entry.state == "rejected" and "damaged since validation" in entry.reason, entry
    assert "checkpoint step 20 rejected: damaged since validation" in caplog.text
    assert f"{shard.name}: sha256" in entry.reason
    assert not config.run_dir.checkpoint(20).exists()  # set aside, never loaded
    assert not store.exists(f"{checkpoint_key('test', 20)}/manifest.json")


def test_upload_then_resume_from_the_store_alone(run, tmp_path):
    config, dataset = run
    store = open_store(str(tmp_path / "store"))
    for step in (10, 20):
        checkpoints.validate_checkpoint(config, step)
        entry = checkpoints.upload_checkpoint(config, step, store)
        assert entry.state == "uploaded"
    assert store.exists("runs/test/checkpoints/step-00000020/manifest.json")
    ledger_in_store = json.loads(store.get_bytes("runs/test/ledger.json"))
    assert {e["state"] for e in ledger_in_store["entries"].values()} == {"uploaded"}

    shutil.rmtree(config.run_dir)  # a new machine: no local tier, no local ledger
    point = checkpoints.resume_point(config, store)
    # Nothing is downloaded up front: the workers read it from the store, each rank its files.
    assert (point.step, point.local, str(point.spec)) == (20, None, "store:20")
    assert checkpoints.resume_position(config, point, store) == CheckpointManifest.model_validate_json(
        store.get_bytes("runs/test/checkpoints/step-00000020/manifest.json")).data_position > 0
    assert not config.run_dir.checkpoint(20).exists()


def test_a_machine_that_trained_the_run_before_resumes_from_what_another_did_since(run, tmp_path):
    """Machine B trained the run up to step 10, then machine A took over and uploaded step 20.
    B, with its own older ledger, resumes from step 20 in the store (not from its 10), and
    what it pushes to the store keeps A's step 20."""
    config, _ = run
    store = open_store(str(tmp_path / "store"))
    checkpoints.validate_checkpoint(config, 10)
    checkpoints.upload_checkpoint(config, 10, store)
    machine_b = small_config(tmp_path / "b", "training.max_steps=20")
    shutil.copytree(config.run_dir, machine_b.run_dir, ignore=shutil.ignore_patterns("step-00000020"))
    checkpoints.validate_checkpoint(config, 20)
    checkpoints.upload_checkpoint(config, 20, store)

    point = checkpoints.resume_point(machine_b, store)
    assert (point.step, point.local) == (20, None)
    assert checkpoints.ledger_of(machine_b).read().entries[10].state == "uploaded"
    checkpoints.ledger_of(machine_b).record(10, "uploaded", note="local copy pruned; store copy kept")
    checkpoints.ledger_of(machine_b).push(store)
    pushed = json.loads(store.get_bytes("runs/test/ledger.json"))["entries"]
    assert pushed["20"]["state"] == "uploaded" and "pruned" in pushed["10"]["history"][-1]["note"]


def test_a_new_machine_evaluates_the_newest_checkpoint_it_can_read(run, tmp_path):
    """The store's ledger names a step validated but not uploaded yet (its upload still runs
    on the training machine): a machine without local copies evaluates the newest uploaded
    one instead, and asking for the other by step says why it cannot."""
    from goodput.evaluation import locate_checkpoint

    config, _ = run
    store = open_store(str(tmp_path / "store"))
    checkpoints.validate_checkpoint(config, 10)
    checkpoints.upload_checkpoint(config, 10, store)
    checkpoints.validate_checkpoint(config, 20)
    checkpoints.ledger_of(config).push(store)  # as the upload of 10 pushes it while 20 is validated

    shutil.rmtree(config.run_dir)  # a new machine
    assert locate_checkpoint(config, store) == config.run_dir.checkpoint(10)
    assert not config.run_dir.checkpoint(10).exists()  # evaluate reads the store's weights
    with pytest.raises(FileNotFoundError, match=r"step 20 .* validated but not uploaded yet.*\[10\]"):
        locate_checkpoint(config, store, 20)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_validation_and_upload_run_at_the_lowest_cpu_priority(run, tmp_path, monkeypatch):
    """Both run beside training: they take the cycles it leaves idle (core.cpu_priority)."""
    import threading

    from core import cpu_priority as background
    from training.checkpoint import verify as ckpt

    config, _ = run
    store = open_store(str(tmp_path / "store"))
    seen = {}
    verify, upload_dir = ckpt.verify_checkpoint, type(store).upload_dir

    def spy_verify(*args, **kwargs):
        seen["verifier"] = thread_nice()
        return verify(*args, **kwargs)

    def spy_upload(*args, **kwargs):
        seen["upload"] = thread_nice()
        return upload_dir(*args, **kwargs)

    monkeypatch.setattr(ckpt, "verify_checkpoint", spy_verify)
    monkeypatch.setattr(type(store), "upload_dir", spy_upload)
    # The verifier's entry point (what the validate task's verifier process runs), here in a
    # thread of its own, since it lowers the thread that runs it.
    verifier = threading.Thread(target=ckpt.main, args=(
        [str(config.run_dir.checkpoint(10)), "--background"],))
    verifier.start()
    verifier.join()
    checkpoints.validate_checkpoint(config, 10)
    caller = thread_nice()
    assert checkpoints.upload_checkpoint(config, 10, store).state == "uploaded"
    assert seen == {"verifier": background.BACKGROUND_NICE, "upload": background.BACKGROUND_NICE}
    assert thread_nice() == caller


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="a kernel with autogroups")
def test_the_verifier_lowers_the_scheduling_group_of_its_own_session(tmp_path):
    """Priorities count within a session's group, and each group gets an equal share of a
    busy CPU: the verifier, in a session of its own, also lowers its group to nice 19 (it
    took as much CPU as a training worker). A process in the caller's session is left alone:
    its group is the caller's."""
    from core.cpu_priority import lower_session_priority
    from goodput.verifier_pool import _Verifier

    verifier = _Verifier()
    try:
        group = open(f"/proc/{verifier.process.pid}/autogroup").read()
        assert group.split()[-1] == "19", group
        assert os.getsid(verifier.process.pid) == verifier.process.pid
    finally:
        verifier.stop()
    ours = open("/proc/self/autogroup").read()
    beside = subprocess.Popen(["sleep", "60"])
    try:
        assert not lower_session_priority(beside.pid)
        assert open("/proc/self/autogroup").read() == ours
    finally:
        beside.kill()
        beside.wait()


def with_a_tokenizer(dataset: Path, copy: Path) -> Path:
    """A copy of the synthetic dataset with a tokenizer: evaluation writes samples as text."""
    from training.tokenizer import train_tokenizer

    shutil.copytree(dataset, copy)
    train_tokenizer([f"sample {i} of the words" for i in range(50)], vocab_size=256,
                    min_frequency=1).save(str(copy / "tokenizer.json"))
    return copy


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="a kernel with autogroups")
def test_an_evaluation_beside_training_lowers_its_sessions_group_and_dies_with_the_flow(run, tmp_path):
    """eval.every_validated's evaluations run beside training: in a session of their own,
    its scheduling group at nice 19 (as the verifier's), and ended by the kernel when the
    process that started them dies (no Ctrl-C to the terminal's group reaches them)."""
    from core.config import dump_config

    config, synthetic = run
    dataset = with_a_tokenizer(synthetic, tmp_path / "dataset")
    (tmp_path / "run.yaml").write_text(dump_config(config))
    flow = subprocess.Popen([sys.executable, "-c", (
        "import sys; from pathlib import Path; from core.config import load_config; "
        "from goodput.evaluation import evaluate; "
        f"evaluate(load_config({str(tmp_path / 'run.yaml')!r}), "
        f"Path({str(config.run_dir.checkpoint(20))!r}), Path({str(dataset)!r}), background=True)")],
        cwd=REPO)
    evaluation = None
    try:
        deadline = time.monotonic() + 120
        while evaluation is None and time.monotonic() < deadline and flow.poll() is None:
            for child in Path("/proc").glob("[0-9]*"):
                try:
                    if (f"PPid:\t{flow.pid}\n" in (child / "status").read_text()
                            and b"training.evaluate" in (child / "cmdline").read_bytes()
                            and (child / "autogroup").read_text().split()[-1] == "19"):
                        evaluation = int(child.name)  # lowered right after its start
                except OSError:
                    continue
            time.sleep(0.05)
        assert evaluation is not None, "no evaluation process with its group at nice 19"
        assert os.getsid(evaluation) == evaluation  # a session of its own
        flow.kill()  # the flow process dies (kill -9, an OOM kill)
        flow.wait()

        def ended() -> bool:  # gone, or a zombie its new parent has not reaped yet
            try:
                return "State:\tZ" in Path(f"/proc/{evaluation}/status").read_text()
            except FileNotFoundError:
                return True

        deadline = time.monotonic() + 30
        while not ended() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ended(), "the evaluation outlived the process that started it"
    finally:
        if flow.poll() is None:
            flow.kill()
            flow.wait()
        if evaluation is not None and Path(f"/proc/{evaluation}").exists():
            os.kill(evaluation, signal.SIGKILL)  # not to outlive a failed test either


def test_a_stopped_training_ends_the_evaluation_beside_it_without_waiting(run, tmp_path):
    """Ctrl-C or a cancellation stops training; the evaluation beside it (in a session of its
    own, out of the terminal's reach) is ended too, not waited for."""
    import threading

    from goodput import evaluation

    config, synthetic = run
    dataset = with_a_tokenizer(synthetic, tmp_path / "dataset")
    outcome = {}

    def evaluate():
        try:
            evaluation.evaluate(config, config.run_dir.checkpoint(20), dataset, background=True)
        except BaseException as e:  # noqa: BLE001 - what the test looks at
            outcome["error"] = e

    flow = threading.Thread(target=evaluate)
    flow.start()
    deadline = time.monotonic() + 60
    while not evaluation._background and flow.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert evaluation.stop_background_evaluations() == 1
    flow.join(timeout=30)
    assert not flow.is_alive()
    assert isinstance(outcome.get("error"), evaluation.EvaluationStopped), outcome
    assert not evaluation._background and not config.run_dir.eval_report(20).exists()


def test_a_machine_without_the_copy_evaluates_the_stores_weights_alone(run, tmp_path, caplog):
    """What an evaluation on a machine without the local copy does: it reads the weights'
    files of the store's copy (each against the manifest), never the optimizer's, scores as
    the local copy does, and a second evaluation reuses the report without fetching. A
    store copy other than the one the ledger names uploaded (being replaced), or a damaged
    stored weights file, fails the evaluation and leaves no report."""
    from goodput import evaluation

    config, synthetic = run
    dataset = with_a_tokenizer(synthetic, tmp_path / "dataset")
    store = store_from_config(config.storage)
    for step in (10, 20):
        checkpoints.validate_checkpoint(config, step)
        checkpoints.upload_checkpoint(config, step, store)
    local = evaluation.evaluate(config, config.run_dir.checkpoint(20), dataset)
    files = {f.path for f in CheckpointManifest.load(config.run_dir.checkpoint(20)).files}
    weights = {f for f in files if re.fullmatch(r"__\d+_model\.distcp", f)}
    assert weights and {f for f in files if re.fullmatch(r"__\d+_training\.distcp", f)}
    ours = copy_id(config.run_dir.checkpoint(20))

    new_machine = small_config(tmp_path / "b", "training.max_steps=20",
                               f"storage.uri={config.storage.uri}")
    checkpoint = evaluation.locate_checkpoint(new_machine, store)
    assert checkpoint == new_machine.run_dir.checkpoint(20) and not checkpoint.exists()
    with caplog.at_level("INFO", logger="goodput.evaluation"):
        report = evaluation.evaluate(new_machine, checkpoint, dataset)
    assert (report.step, report.loss, report.copy_id) == (20, local.loss, ours)
    assert f"step 20: read the weights from {store.url(checkpoint_key('test', 20))}: fetched" \
        in caplog.text
    assert [s.completion for s in report.samples] == [s.completion for s in local.samples]
    fetched = new_machine.run_dir.fetched_from_store(20)
    assert {p.name for p in fetched.iterdir()} == weights | {".metadata"}
    assert not checkpoint.exists()  # no local copy: nothing resumes from half a checkpoint
    assert evaluation.evaluate(new_machine, checkpoint, dataset) == report  # reused

    key = checkpoint_key("test", 10)  # step 10's store copy, not the one its ledger names
    manifest = store.get_bytes(f"{key}/manifest.json")
    (tmp_path / "other.json").write_bytes(manifest + b"\n")
    store.put_file(tmp_path / "other.json", f"{key}/manifest.json")
    with pytest.raises(RuntimeError, match="not the copy .* the run's ledger names uploaded"):
        evaluation.evaluate(new_machine, new_machine.run_dir.checkpoint(10), dataset)
    (tmp_path / "other.json").write_bytes(manifest)
    store.put_file(tmp_path / "other.json", f"{key}/manifest.json")

    shutil.rmtree(fetched)  # a new evaluation of step 10, its stored weights damaged
    damaged = tmp_path / "damaged"
    store.get_file(f"{key}/{sorted(weights)[0]}", damaged)
    flip_bytes(damaged)
    store.put_file(damaged, f"{key}/{sorted(weights)[0]}")
    with pytest.raises(RuntimeError, match="sha256 differs"):
        evaluation.evaluate(new_machine, new_machine.run_dir.checkpoint(10), dataset)
    assert not new_machine.run_dir.eval_report(10).exists()


def test_an_evaluation_runs_in_the_process_started_before_its_checkpoint_was_known(
        run, tmp_path, monkeypatch):
    """The pipeline starts its evaluation's process as training ends, to import while the
    train flow finishes: the evaluation then runs there and scores as a new process does.
    One started in another environment than the evaluation's (torch read it at its import)
    is stopped, not used; one never used exits once its input closes."""
    from goodput import evaluation

    config, synthetic = run
    dataset = with_a_tokenizer(synthetic, tmp_path / "dataset")
    new_processes = []
    popen = subprocess.Popen

    def counted(*args, **kwargs):
        new_processes.append(args[0])
        return popen(*args, **kwargs)

    evaluation.start_evaluation_process()
    started, _ = evaluation._started
    monkeypatch.setattr(evaluation.subprocess, "Popen", counted)
    monkeypatch.chdir(tmp_path)  # its requests carry the caller's working directory
    told = evaluation.evaluate(config, config.run_dir.checkpoint(20), dataset)
    assert new_processes == [] and started.returncode == 0 and evaluation._started is None
    config.run_dir.eval_report(20).unlink()
    anew = evaluation.evaluate(config, config.run_dir.checkpoint(20), dataset)
    assert len(new_processes) == 1 and "--when-told" not in new_processes[0]
    assert (told.loss, told.bits_per_byte, [s.completion for s in told.samples]) == \
        (anew.loss, anew.bits_per_byte, [s.completion for s in anew.samples])

    monkeypatch.setattr(evaluation.subprocess, "Popen", popen)
    evaluation.start_evaluation_process()
    started, _ = evaluation._started
    monkeypatch.setattr(evaluation.subprocess, "Popen", counted)
    monkeypatch.setenv("GOODPUT_SET_AFTER_IT_STARTED", "1")
    evaluation.evaluate(config, config.run_dir.checkpoint(10), dataset)
    assert len(new_processes) == 2 and started.returncode == -signal.SIGKILL

    unused = subprocess.run([sys.executable, "-m", "training.evaluate", "--when-told"], input="",
                            capture_output=True, text=True, timeout=120)
    assert (unused.returncode, unused.stdout, unused.stderr) == (0, "", "")


def test_fetched_weights_are_kept_for_the_newest_steps_only(run):
    """A machine that only evaluates keeps the files fetched for the newest keep_local steps;
    once a newer checkpoint is on local disk, none older is kept. Files being read (a
    resume's, an evaluation's) wait for a later call."""
    from core.files import reading_folder

    config, _ = run
    for step in (5, 10, 15, 20, 25):
        (config.run_dir.fetched_from_store(step)).mkdir(parents=True)
    shutil.rmtree(config.run_dir.checkpoint(20))
    with reading_folder(config.run_dir.fetched_from_store(5)):
        assert checkpoints.prune_fetched(config) == [10]  # keep_local=3: 15, 20, 25 kept
    assert checkpoints.prune_fetched(config) == [5]
    assert checkpoints.prune_fetched(config) == []
    cfg = small_config(config.run_dir.path.parent.parent, "training.max_steps=20",
                       "checkpoint.keep_local=5")
    for step in (5, 10):
        (cfg.run_dir.fetched_from_store(step)).mkdir(parents=True)
    assert checkpoints.prune_fetched(cfg) == [5]  # older than the local step 10


def test_a_step_saved_again_is_another_copy_judged_and_uploaded_on_its_own(run, tmp_path):
    """Workers restarted from an older checkpoint save a step again whose first copy was
    validated and uploaded: the new copy is not taken on the first one's verdict. It is
    yielded again, judged, and replaces the store copy manifest-first."""
    import threading

    from core.protocol import checkpoint_lock as step_lock
    from training.checkpoint.saving import clear_for_save as _clear_for_save

    config, _ = run
    store = open_store(str(tmp_path / "store"))
    path = config.run_dir.checkpoint(20)
    for step in (10, 20):
        checkpoints.validate_checkpoint(config, step)
        checkpoints.upload_checkpoint(config, step, store)
    first = copy_id(path)
    assert checkpoints.ledger_of(config).read().entries[20].copy_id == first
    assert list(checkpoints.new_checkpoints(config, lambda: False)) == []  # all settled

    # The trainer clears the step for its new save only while the flow holds no lock on it.
    with step_lock(path):
        clearing = threading.Thread(target=_clear_for_save, args=(path,))
        clearing.start()
        clearing.join(timeout=0.5)
        assert clearing.is_alive() and copy_id(path) == first
    clearing.join()
    assert not path.exists() and list((config.run_dir.checkpoints / "superseded").iterdir())
    superseded = next((config.run_dir.checkpoints / "superseded").iterdir())
    shutil.copytree(superseded, path)  # the new save (same tensors, a manifest of its own)
    manifest = CheckpointManifest.load(path)
    manifest.created_at += 1
    manifest.save(path)
    second = copy_id(path)
    assert second != first

    assert checkpoints.unjudged_steps(config) == [20]
    assert list(checkpoints.new_checkpoints(config, lambda: False)) == [20]
    entry = checkpoints.validate_checkpoint(config, 20)
    assert (entry.state, entry.copy_id) == ("validated", second)
    assert "saved again after a uploaded copy" in [t.note for t in entry.history][-2]
    checkpoints.upload_checkpoint(config, 20, store)
    stored = CheckpointManifest.model_validate_json(
        store.get_bytes(f"{checkpoint_key('test', 20)}/manifest.json"))
    assert stored.created_at == manifest.created_at
    assert checkpoints.resume_point(config, store).local == path


def test_retention_keeps_a_new_copy_of_an_uploaded_step_until_it_is_uploaded(run, tmp_path):
    config, _ = run
    config = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(update={"keep_local": 1})})
    store = open_store(str(tmp_path / "store"))
    for step in (10, 20):
        checkpoints.validate_checkpoint(config, step)
        checkpoints.upload_checkpoint(config, step, store)
    manifest = CheckpointManifest.load(config.run_dir.checkpoint(10))
    manifest.created_at += 1  # step 10 saved again: the store holds the other copy
    manifest.save(config.run_dir.checkpoint(10))
    assert checkpoints.prune_local(config) == []
    checkpoints.validate_checkpoint(config, 10)
    assert checkpoints.prune_local(config) == []
    checkpoints.upload_checkpoint(config, 10, store)
    assert checkpoints.prune_local(config) == [10]


def test_upload_refuses_a_copy_other_than_the_validated_one(run, tmp_path):
    config, _ = run
    path = config.run_dir.checkpoint(20)
    checkpoints.validate_checkpoint(config, 20)
    manifest = CheckpointManifest.load(path)
    manifest.created_at += 1  # saved again after validation, not yet judged
    manifest.save(path)
    with pytest.raises(checkpoints.CopySuperseded, match="not the copy that was validated"):
        checkpoints.upload_checkpoint(config, 20, open_store(str(tmp_path / "store")))


def test_the_upload_task_of_a_superseded_copy_completes_without_uploading(run, prefect_api):
    """The train flow's upload of a copy that training replaced since its validation has
    nothing to do: the task completes (the flow does not fail on it) and the store is
    untouched; the new copy gets its own validation and upload."""
    from prefect.states import Completed

    from tasks.train import upload_checkpoint

    config, _ = run
    path = config.run_dir.checkpoint(20)
    checkpoints.validate_checkpoint(config, 20)
    manifest = CheckpointManifest.load(path)
    manifest.created_at += 1  # saved again after validation
    manifest.save(path)
    state = upload_checkpoint(config, 20, return_state=True)
    assert state.type == Completed().type and state.result() is None
    assert not store_from_config(config.storage).list("runs/test/checkpoints")
    assert checkpoints.ledger_of(config).read().entries[20].state == "validated"


def test_checkpoint_damaged_after_validation_is_never_loaded(run, tmp_path):
    """A validated checkpoint whose file rots on disk fails its checksums at load: the
    attempt stops, the damaged copy goes aside, the retry resumes from the store copy (read
    per rank), and the step the run saves again after a rejection is judged afresh."""
    config, dataset = run
    store = store_from_config(config.storage)
    full = losses_by_step(config.run_dir)
    checkpoints.validate_checkpoint(config, 10)
    checkpoints.upload_checkpoint(config, 10, store)
    flip_bytes(next(config.run_dir.checkpoint(20).glob("*.distcp")))
    assert checkpoints.validate_checkpoint(config, 20).state == "rejected"
    shard = sorted(config.run_dir.checkpoint(10).glob("*.distcp"))[0]
    flip_bytes(shard)  # after validation and upload: only the local copy is damaged

    lines = []
    with pytest.raises(TrainingFailed) as failed:
        train_attempt(config, dataset, store, "damaged-1", lines.append)
    assert failed.value.failure_class == "corrupt_checkpoint" and failed.value.retry
    entry = checkpoints.ledger_of(config).read().entries[10]
    assert entry.state == "uploaded" and "local copy damaged" in entry.history[-1].note
    assert shard.name in entry.history[-1].note and not config.run_dir.checkpoint(10).exists()
    assert list((config.run_dir / "checkpoints" / "rejected").glob("step-00000010-*"))

    (config.run_dir / "metrics.jsonl").unlink()
    result = train_attempt(config, dataset, store, "damaged-2", lines.append)
    assert result.failure_class == "done" and result.step == 20, "\n".join(lines[-30:])
    assert "resuming from step-00000010 in the store" in "\n".join(lines)
    resumed = losses_by_step(config.run_dir)
    assert sorted(resumed) == list(range(11, 21)) and all(resumed[s] == full[s] for s in resumed)
    # Step 20 was rejected; the run saved it again: that copy is judged on its own.
    assert checkpoints.validate_checkpoint(config, 20).state == "validated"
    assert [t.state for t in checkpoints.ledger_of(config).read().entries[20].history][-3:] == [
        "rejected", "committed", "validated"]
    fetched = config.run_dir / "checkpoints" / ".from-store" / "step-00000010"
    assert fetched.is_dir()  # what the ranks fetched to resume; gone once a newer one is local
    checkpoints.prune_local(config)
    assert not fetched.exists()


def test_readers_refuse_files_that_differ_from_the_manifest(run, tmp_path):
    """What a rank checks before DCP reads a file: the local copy, and the store's (fetched
    twice before it is called damaged)."""
    config, _ = run
    store = store_from_config(config.storage)
    path = config.run_dir.checkpoint(10)
    store.upload_dir(path, checkpoint_key("test", 10), last=("manifest.json",))
    shard = sorted(path.glob("*.distcp"))[0]
    VerifiedReader(path)._obtain(shard.name)  # whole: no complaint
    flip_bytes(shard)
    with pytest.raises(CheckpointCorrupt, match=f"{shard.name}: sha256 differs") as local:
        VerifiedReader(path)._obtain(shard.name)
    assert local.value.step == 10 and not local.value.from_store
    shard.unlink()
    with pytest.raises(CheckpointCorrupt, match="missing"):
        VerifiedReader(path)._obtain(shard.name)

    flip_bytes(store.path(f"{checkpoint_key('test', 10)}/{shard.name}"))
    reader = StoreReader(store, checkpoint_key("test", 10), tmp_path / "cache")
    with pytest.raises(CheckpointCorrupt, match="fetched twice") as remote:
        reader._obtain(shard.name)
    assert remote.value.from_store and not (tmp_path / "cache" / shard.name).exists()
    assert checkpoints.set_aside_damaged(config, 10, True, remote.value.reason).state == "rejected"


def test_a_damaged_local_checkpoint_is_not_loaded_for_evaluation(run, tmp_path):
    """load_model (evaluation's) checks the local files against the manifest, as a read
    from the store does: a byte changed since validation was scored silently, its report
    kept as the checkpoint's; a shard cut short failed with DCP's EOFError."""
    from training.checkpoint.reader import load_model

    config, _ = run
    copy = tmp_path / "step-00000010"
    shutil.copytree(config.run_dir.checkpoint(10), copy)
    load_model(copy, torch.device("cpu"))  # whole: loads
    weights = sorted(copy.glob("*model*.distcp")) or sorted(copy.glob("*.distcp"))
    flip_bytes(weights[0])
    with pytest.raises(CheckpointCorrupt, match=f"{weights[0].name}: sha256 differs"):
        load_model(copy, torch.device("cpu"))
    os.truncate(weights[0], 1000)
    with pytest.raises(CheckpointCorrupt, match=weights[0].name):
        load_model(copy, torch.device("cpu"))


@pytest.mark.slow  # CI: the resume leg of test_async_saves_commit_the_same_state[process]
def test_resume_continues_the_exact_loss_curve(trained, tmp_path):
    root, dataset = trained
    full = losses_by_step(small_config(root, "training.max_steps=20").run_dir)
    shutil.copytree(root / "runs", tmp_path / "runs")
    config = small_config(tmp_path, "training.max_steps=20")
    shutil.rmtree(config.run_dir.checkpoint(20))
    (config.run_dir / "metrics.jsonl").unlink()
    proc = torchrun_training(config, dataset, resume=str(config.run_dir.checkpoint(10)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = losses_by_step(config.run_dir)
    assert sorted(resumed) == list(range(11, 21))
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)


def test_prune_keeps_newest_and_anything_not_uploaded(run, tmp_path):
    config, _ = run
    config = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(update={"keep_local": 1})})
    store = open_store(str(tmp_path / "store"))
    checkpoints.validate_checkpoint(config, 10)
    checkpoints.validate_checkpoint(config, 20)
    assert checkpoints.prune_local(config) == []  # step 10 is not in the store yet
    checkpoints.upload_checkpoint(config, 10, store)
    assert checkpoints.prune_local(config) == [10]
    assert [p.name for p in config.run_dir.committed_checkpoints()] == ["step-00000020"]
    assert torch.isfinite(load_all_tensors(config.run_dir.checkpoint(20), "model.")
                          ["model.output.weight"]).all()


def test_retention_keeps_the_newest_copies_set_aside(run):
    """Rejected copies and superseded ones (a step saved again) are kept for inspection, the
    newest checkpoint.keep_aside of each kind; a run of many rollbacks does not fill its disk."""
    config, _ = run
    config = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(update={"keep_aside": 1})})
    for _ in range(3):  # a step saved again and again
        shutil.copytree(config.run_dir.checkpoint(20), config.run_dir.checkpoint(30))
        set_aside(config.run_dir.checkpoint(30), "superseded")
    for step in (10, 20):
        set_aside(config.run_dir.checkpoint(step), "rejected")
    rejected = sorted((config.run_dir.checkpoints / "rejected").iterdir(),
                      key=lambda p: int(p.name.rsplit("-", 1)[1]))
    superseded = sorted((config.run_dir.checkpoints / "superseded").iterdir(),
                        key=lambda p: int(p.name.rsplit("-", 1)[1]))
    assert checkpoints.prune_aside(config) == [f"rejected/{rejected[0].name}"] + [
        f"superseded/{p.name}" for p in superseded[:2]]
    assert list((config.run_dir.checkpoints / "rejected").iterdir()) == [rejected[1]]
    assert list((config.run_dir.checkpoints / "superseded").iterdir()) == [superseded[2]]
    assert checkpoints.prune_aside(config) == []


def test_store_retention_keeps_every_mth_best_and_newest(run, tmp_path):
    """Store retention drops a step only once the local tier let it go too: while one of the
    newest keep_local, its store copy stays and it stays resumable."""
    config, _ = run
    config = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(
        update={"store_keep_every": 20, "keep_local": 2})})
    store = open_store(str(tmp_path / "store"))
    for step in (10, 20):
        checkpoints.validate_checkpoint(config, step)
        checkpoints.upload_checkpoint(config, step, store)
    assert checkpoints.apply_retention(config, store) == {"local": [], "store": [], "aside": []}
    assert is_committed(config.run_dir.checkpoint(10))
    assert store.exists("runs/test/checkpoints/step-00000010/manifest.json")
    assert checkpoints.ledger_of(config).read().entries[10].state == "uploaded"

    config = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(update={"keep_local": 1})})
    # 20: a multiple of 20, and the newest
    assert checkpoints.apply_retention(config, store) == {"local": [10], "store": [10], "aside": []}
    assert not store.list("runs/test/checkpoints/step-00000010")
    assert store.exists("runs/test/checkpoints/step-00000020/manifest.json")
    ledger = checkpoints.ledger_of(config).read()
    assert ledger.entries[10].state == "pruned" and "retention" in ledger.entries[10].history[-1].note
    assert json.loads(store.get_bytes("runs/test/ledger.json"))["entries"]["10"]["state"] == "pruned"
    assert checkpoints.resume_point(config, store).local == config.run_dir.checkpoint(20)


def test_restarted_workers_never_take_a_copy_saved_after_its_step_was_validated(run):
    """In-job restarts resume from what the ledger validated: a step saved again since (by
    workers restarted from an older checkpoint) is another copy, not judged yet, so the
    restart waits for its verdict and, without one, takes the newest judged copy."""
    from core.protocol import ResumeSpec
    from training.checkpoint.resume import newest_validated

    config, _ = run
    for step in (10, 20):
        checkpoints.validate_checkpoint(config, step)
    assert newest_validated(config.run_dir, wait_s=0) == ResumeSpec.directory(config.run_dir.checkpoint(20))
    manifest = CheckpointManifest.load(config.run_dir.checkpoint(20))
    manifest.created_at += 1  # step 20 saved again
    manifest.save(config.run_dir.checkpoint(20))
    assert newest_validated(config.run_dir, wait_s=0) == ResumeSpec.directory(config.run_dir.checkpoint(10))


@pytest.mark.parametrize("mode", [pytest.param("thread", marks=pytest.mark.slow),  # CI: process,
                                  "process"])  # where the risk lies (the writer's own process)
def test_the_emergency_save_survives_the_sigterm_that_asks_for_it(trained, tmp_path, mode):
    """torchrun stops a worker by signalling its whole process group, which in process mode
    holds DCP's writer process too: the writer must outlive the signal, or the emergency
    checkpoint (and every step since the last one) is lost."""
    root, dataset = trained
    config = small_config(tmp_path, "training.max_steps=20", f"checkpoint.async_mode={mode}",
                          "faults.sigterm_at_step=13", "training.log_every=5")
    proc = torchrun_training(config, dataset)
    assert "emergency save failed" not in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    committed = [p.name for p in config.run_dir.committed_checkpoints()]
    # The save at the step the workers learn of the signal: 13 (the injection waits until
    # torchrun passed it on).
    assert committed == ["step-00000010", "step-00000013"], \
        (committed, proc.stdout[-3000:], proc.stderr[-3000:])
    # As at the time limit: the steps since the last metrics record are in the emergency
    # checkpoint, and the next attempt resumes after them, so this attempt logs them.
    saved_at = int(committed[1].removeprefix("step-"))
    records = read_metrics(config.run_dir)
    assert [(r["step"], r["window_steps"]) for r in records] == [(5, 5), (10, 5), (saved_at, saved_at - 10)]
    assert all(verify_checkpoint(p)["ok"] for p in config.run_dir.committed_checkpoints())
    # What the supervisor saw last: a save under way (its allowance), not a stalled step.
    beat = json.loads((config.run_dir / "heartbeat.json").read_text())
    assert beat["phase"] == "checkpoint" and f"step-{beat['step']:08d}" == committed[1]


@pytest.mark.parametrize("mode", [pytest.param("thread", marks=pytest.mark.slow),  # CI: the default, process
                                  "process"])
def test_async_saves_commit_the_same_state(trained, tmp_path, mode):
    """Background saves snapshot the state at the step they were taken: resuming from one
    continues the synchronous run's curve exactly, and training was blocked only to stage."""
    root, dataset = trained
    full = losses_by_step(small_config(root, "training.max_steps=20").run_dir)
    config = small_config(tmp_path, "training.max_steps=20", f"checkpoint.async_mode={mode}")
    proc = torchrun_training(config, dataset)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert losses_by_step(config.run_dir) == full
    assert [p.name for p in config.run_dir.committed_checkpoints()] == ["step-00000010", "step-00000020"]
    assert all(verify_checkpoint(p)["ok"] for p in config.run_dir.committed_checkpoints())

    # DDP: each rank staged and wrote half of the replicated state, not all of it.
    share = re.search(r"rank 0 stages and writes ([\d.]+) MB of the ([\d.]+) MB of tensors it "
                      r"holds; 2 ranks hold the same", proc.stdout)
    assert share, proc.stdout
    mine, held = map(float, share.groups())
    assert 0.4 * held < mine < 0.6 * held

    shutil.rmtree(config.run_dir.checkpoint(20))
    (config.run_dir / "metrics.jsonl").unlink()
    proc = torchrun_training(config, dataset, resume=str(config.run_dir.checkpoint(10)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = losses_by_step(config.run_dir)
    assert all(resumed[s] == full[s] for s in range(11, 21))


def test_ranks_that_hold_the_same_tensors_split_them_balanced():
    """Which tensors a rank stages and writes: the ranks holding exactly what it holds (same
    digest) split them, balanced by bytes; a rank no other matches keeps all it holds."""
    from training.checkpoint.replicas import assign_units as my_share
    from training.checkpoint.replicas import holdings_digest

    def unit(key, offsets=()):
        return ("model", key, offsets)

    replicated = {unit(f"w{i}"): n for i, n in enumerate([400, 300, 200, 100, 100, 50])}
    digests = [holdings_digest(replicated)] * 2  # DDP on 2 ranks
    shares = [my_share(replicated, digests, rank) for rank in (0, 1)]
    assert shares[0] | shares[1] == set(replicated) and not shares[0] & shares[1]
    loads = [sum(replicated[u] for u in share) for share in shares]
    assert max(loads) - min(loads) <= 50
    reordered = dict(reversed(replicated.items()))  # what a peer computes does not depend on order
    assert my_share(reordered, [holdings_digest(reordered)] * 2, 0) == shares[0]

    # Pipeline stages x DDP: each stage's replicas split that stage's tensors.
    stage0, stage1 = {unit("a"): 10, unit("b"): 10}, {unit("c"): 10, unit("d"): 10}
    digests = [holdings_digest(stage0)] * 2 + [holdings_digest(stage1)] * 2
    assert my_share(stage0, digests, 0) | my_share(stage0, digests, 1) == set(stage0)
    assert my_share(stage1, digests, 2) | my_share(stage1, digests, 3) == set(stage1)
    assert all(len(my_share(held, digests, rank)) == 1
               for rank, held in enumerate([stage0, stage0, stage1, stage1]))

    # FSDP: every rank holds other chunks (and the same small plain tensors): each keeps all.
    chunks = [{unit("w", (0, 0)): 500, unit("step"): 8}, {unit("w", (4, 0)): 500, unit("step"): 8}]
    digests = [holdings_digest(held) for held in chunks]
    assert [my_share(held, digests, rank) for rank, held in enumerate(chunks)] == \
        [set(held) for held in chunks]


def test_ranks_resume_from_the_store_fetching_only_what_their_plan_reads(tmp_path):
    """FSDP on 2 ranks resumes from the store alone (no local tier): each rank fetches only
    the files its part of the state is in, verified, and the loss curve continues."""
    dataset = synthetic_dataset(tmp_path / "dataset")
    config = small_config(tmp_path, "training.max_steps=20", "parallelism.dp_replicate=1",
                          "parallelism.dp_shard=2")
    proc = torchrun_training(config, dataset)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    full = losses_by_step(config.run_dir)
    store = store_from_config(config.storage)
    store.upload_dir(config.run_dir.checkpoint(10), checkpoint_key("test", 10))
    shutil.rmtree(config.run_dir / "checkpoints")  # a node that never saw the local tier
    (config.run_dir / "metrics.jsonl").unlink()

    proc = torchrun_training(config, dataset, resume="store:10")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fetched = {int(m[1]): set(m[2].split(", ")) - {"nothing new"} for m in
               re.finditer(r"rank (\d) fetched (.+) of \d+ files from ", proc.stdout)}
    # Each rank fetches only files its DCP read plan references, and a file another rank of
    # the node already fetched is reused. Its model shards are in its own weights file, its
    # optimizer shards in its own training-state file; the small replicated entries (step,
    # data position, RNG) were written once, by whichever rank DCP's dedup chose, so a rank
    # also reads the files holding those.
    stored = dcp.FileSystemReader(str(store.path(checkpoint_key("test", 10)))).read_metadata()
    replicated = {info.relative_path for index, info in stored.storage_data.items()
                  if not index.fqn.startswith(("model.", "optim."))}
    everything = {".metadata", "__0_model.distcp", "__1_model.distcp", "__0_training.distcp",
                  "__1_training.distcp"}
    for rank in (0, 1):
        assert fetched[rank] - {".metadata"} <= ({f"__{rank}_model.distcp",
                                                  f"__{rank}_training.distcp"} | replicated), rank
    assert set().union(*fetched.values()) == everything
    assert {p.name for p in (config.run_dir / "checkpoints" / ".from-store" /
                             "step-00000010").iterdir()} == everything
    resumed = losses_by_step(config.run_dir)
    assert sorted(resumed) == list(range(11, 21))
    assert all(resumed[s] == full[s] for s in resumed)


def test_a_checkpoint_of_another_model_is_a_config_error_not_a_crash_to_retry(tmp_path):
    # A run saved with an unpadded vocabulary (300 ids), then resumed by code that pads it to
    # 384: its old config.yaml, which predates model.vocab_multiple_of, reloads with the
    # default. Loading would fail on a shape mismatch in every attempt.
    from core.protocol import FailureClass, read_exit_records

    dataset = synthetic_dataset(tmp_path / "dataset", vocab_size=300)
    saved = small_config(tmp_path, "training.max_steps=10", "model.vocab_multiple_of=1")
    assert torchrun_training(saved, dataset).returncode == 0
    (saved.run_dir / "config.yaml").unlink()  # as if written before the field existed
    # Both runs are attempt "0" here (a launcher gives each attempt its own id): the first
    # run's records go, or a rank that torchrun stops before it writes its own (the other
    # failed first) would show the first run's "done" (a CI run under load).
    for record in saved.run_dir.attempt("0").glob("rank-*.json"):
        record.unlink()

    proc = torchrun_training(small_config(tmp_path, "training.max_steps=20"), dataset)
    assert proc.returncode != 0
    records = read_exit_records(saved.run_dir, "0")
    assert records and {r["code"] for r in records} == {FailureClass.CONFIG.exit_code}, records
    reason = records[0]["reason"]
    assert "vocab_size (padded) 300 in the checkpoint, 384 now" in reason
    assert "model.vocab_multiple_of=1" in reason


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_a_background_save_writes_and_hashes_at_the_lowest_cpu_priority(tmp_path, monkeypatch):
    """The shard writer and the manifest's hashing take only the cycles training leaves idle;
    the training thread keeps its priority (core.cpu_priority). An urgent save does not."""
    from core import cpu_priority as background
    from core.protocol import is_committed
    from training.checkpoint import saving, writer

    seen = {}
    write_data, list_files_ = writer.BackgroundWriter.write_data, saving.list_files

    def spy_write(self, plan, planner):
        seen["writer"] = thread_nice()
        return write_data(self, plan, planner)

    def spy_hash(*args, **kwargs):
        seen["hashing"] = thread_nice()
        return list_files_(*args, **kwargs)

    monkeypatch.setattr(writer.BackgroundWriter, "write_data", spy_write)
    monkeypatch.setattr(saving, "list_files", spy_hash)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    training_thread = thread_nice()
    checkpointer = saving.Saver("thread")
    path = tmp_path / "step-00000001"
    fields = dict(step=1, tokens_seen=0, world_size=1, layout={}, config_hash="c", dataset_id="d",
                  model_args={}, loss=1.0)
    checkpointer.save(path, [model], [optimizer], {}, fields)
    checkpointer.close()
    assert not checkpointer.failures
    assert is_committed(path) and verify_files(path, CheckpointManifest.load(path).files) == []
    assert seen == {"writer": background.BACKGROUND_NICE, "hashing": background.BACKGROUND_NICE}
    assert thread_nice() == training_thread

    # The emergency save (within the launcher's grace period) does not wait for idle cycles.
    seen.clear()
    urgent = tmp_path / "step-00000002"
    checkpointer = saving.Saver("thread")
    checkpointer.save(urgent, [model], [optimizer], {}, {**fields, "step": 2}, urgent=True)
    checkpointer.close()
    assert is_committed(urgent) and not checkpointer.failures
    assert seen == {"hashing": training_thread}


@pytest.mark.parametrize("mode", ["sync", "thread"])  # process mode: test_async_saves_commit...
def test_a_save_hashes_its_files_as_written_and_skips_the_zip_crc(tmp_path, monkeypatch, mode):
    """The manifest's digests come from the writers, which hash their bytes on the way out:
    the commit reads no file back, and the digests match the files on disk. torch.save's zip
    CRC-32 of every tensor record, which nothing reads, is not computed (each record's CRC
    field is 0), and the process's setting is what it was. The save reloads exactly."""
    import io
    import zipfile

    from torch.utils.serialization import config as serialization_config

    from storage import manifests
    from training.checkpoint import saving
    from training.checkpoint.reader import load_all_tensors

    read_back = []
    sha256_file = manifests.sha256_file
    monkeypatch.setattr(manifests, "sha256_file", lambda p: read_back.append(p) or sha256_file(p))
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    path = tmp_path / "step-00000001"
    fields = dict(step=1, tokens_seen=0, world_size=1, layout={}, config_hash="c", dataset_id="d",
                  model_args={}, loss=1.0)
    checkpointer = saving.Saver(mode)
    checkpointer.save(path, [model], [optimizer], {}, fields)
    checkpointer.close()
    assert not checkpointer.failures
    assert read_back == []
    monkeypatch.undo()
    manifest = CheckpointManifest.load(path)
    assert manifest.files == list_files(path, exclude=("manifest.json",))  # hashed from disk now
    # The weights and the rest in files of their own; the digests file gone.
    assert {f.path for f in manifest.files} == {".metadata", "__0_model.distcp", "__0_training.distcp"}
    weights_file = {info.relative_path for index, info in
                    dcp.FileSystemReader(str(path)).read_metadata().storage_data.items()
                    if index.fqn.startswith("model.")}
    assert weights_file == {"__0_model.distcp"}
    assert serialization_config.save.compute_crc32  # torch's default, back in place

    storage = dcp.FileSystemReader(str(path)).read_metadata().storage_data
    tensor_records = 0
    for info in storage.values():
        data = (path / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
        if data[:2] != b"PK":
            continue  # a pickled object (BYTE_IO), not a torch.save archive
        crcs = [entry.CRC for entry in zipfile.ZipFile(io.BytesIO(data)).infolist()]
        assert crcs and set(crcs) == {0}, (info, crcs)
        tensor_records += 1
    assert tensor_records >= 4  # weight, bias and their AdamW moments at least
    saved = load_all_tensors(path, prefix="model.")
    assert torch.equal(saved["model.weight"], model.weight.detach())


@pytest.mark.parametrize("change", ["truncated", "deleted"])
def test_a_file_that_changed_after_its_write_is_never_committed(tmp_path, change):
    """The manifest records what the writers wrote; a shard that is shorter or gone by commit
    time fails the commit instead of being blessed or left out."""
    from core.protocol import is_committed
    from training.checkpoint.saving import Saver

    def change_a_shard(point, step):
        if point == "before_manifest":
            if change == "deleted":
                (path / "__0_training.distcp").unlink()
            else:
                with open(path / "__0_training.distcp", "r+b") as f:
                    f.truncate(100)

    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    path = tmp_path / "step-00000001"
    fields = dict(step=1, tokens_seen=0, world_size=1, layout={}, config_hash="c", dataset_id="d",
                  model_args={}, loss=1.0)
    checkpointer = Saver("thread", fault_hook=change_a_shard)
    checkpointer.save(path, [model], [optimizer], {}, fields)
    checkpointer.close()
    assert not is_committed(path)
    assert len(checkpointer.failures) == 1
    assert ("__0_training.distcp: 100 bytes on disk, but its writer wrote" if change == "truncated"
            else "__0_training.distcp written but not found") in checkpointer.failures[0]


def test_a_hashed_file_is_on_disk_before_dcp_fsyncs_it(tmp_path):
    """DCP fsyncs `.metadata` by descriptor without flushing Python's buffer first: taking the
    descriptor flushes, so the fsync covers every byte (and the digest is of those bytes)."""
    import hashlib
    import os

    from training.checkpoint.writer import _HashingFileSystem

    fs = _HashingFileSystem()
    with fs.create_stream(tmp_path / ".metadata.tmp", "wb") as stream:
        stream.write(b"x" * 1200)
        assert os.fstat(stream.fileno()).st_size == 1200
    fs.rename(tmp_path / ".metadata.tmp", tmp_path / ".metadata")
    entry = fs.written[".metadata"]
    assert (entry.path, entry.size, entry.sha256) == (".metadata", 1200, hashlib.sha256(b"x" * 1200).hexdigest())


def test_the_stager_keeps_its_buffers_when_torch_closes_it_after_a_save():
    """torch 2.11's DefaultStager closes its inner StateDictStager after every stage, which
    emptied its type dispatch table (the run's second save failed with "KeyError: <class
    'type'>", seen on an H100) and dropped its staging buffers. The trainer's stager stages
    again into the same buffers, and frees them only when the checkpointer closes it."""
    from training.checkpoint.writer import CpuStager

    stager = CpuStager(shared_memory=False, before_copy=lambda: None)
    state = {"w": torch.arange(6.0), "kind": torch.Tensor, "step": 3}  # a class object too
    buffers = set()
    for step in (1, 2):
        state["w"] += 1
        staged = stager.stage(state).result()
        assert torch.equal(staged["w"], state["w"]) and staged["kind"] is torch.Tensor
        buffers.add(staged["w"].untyped_storage().data_ptr())
        stager._state_dict_stager.close()  # what torch 2.11 does at the end of each stage
    assert len(buffers) == 1
    stager.close()
    assert not stager._state_dict_stager._cached_storage_mapping


def _another_machine_uploads_step_20(config, store, tmp_path):
    """Machine A (`config`) validated step 20 and died before uploading it; machine B, a fresh
    clone, resumed from the store's step 10 and trained, validated and uploaded its own copy of
    step 20 (the same trajectory, saved later: a manifest of its own). Returns B's config."""

    for step in (10, 20):
        checkpoints.validate_checkpoint(config, step)
    checkpoints.upload_checkpoint(config, 10, store)
    machine_b = small_config(tmp_path / "b", "training.max_steps=20")
    assert checkpoints.resume_point(machine_b, store).step == 10
    theirs = machine_b.run_dir.checkpoint(20)
    shutil.copytree(config.run_dir.checkpoint(20), theirs)
    manifest = CheckpointManifest.load(theirs)
    manifest.created_at += 1
    manifest.save(theirs)
    assert checkpoints.validate_checkpoint(machine_b, 20).state == "validated"
    entry = checkpoints.upload_checkpoint(machine_b, 20, store)
    assert entry.state == "uploaded" and entry.copy_id == copy_id(theirs) != copy_id(config.run_dir.checkpoint(20))
    return machine_b


def _stored_files(store, step):
    return {k: store.get_bytes(k) for k in store.list(checkpoint_key("test", step))}


def test_a_machine_adopts_the_copy_another_uploaded_instead_of_uploading_over_it(run, tmp_path):
    """A reruns: it learns from the store's ledger that B uploaded step 20. Its own older copy
    is not validated and uploaded again over B's (1.32 GB for nothing, the store's copy
    half-replaced meanwhile): B's copy is adopted, A's moved aside, nothing left to secure."""

    config, _ = run
    store = open_store(str(tmp_path / "store"))
    machine_b = _another_machine_uploads_step_20(config, store, tmp_path)
    theirs = copy_id(machine_b.run_dir.checkpoint(20))
    before = _stored_files(store, 20)

    point = checkpoints.resume_point(config, store)  # the rerun on A
    assert (point.step, point.local) == (20, None)  # B's copy, read from the store
    entry = checkpoints.ledger_of(config).read().entries[20]
    assert (entry.state, entry.copy_id) == ("uploaded", theirs)
    assert "adopted" in entry.history[-1].note and "superseded" in entry.history[-1].note
    assert not config.run_dir.checkpoint(20).exists()
    assert [p.name.rsplit("-", 1)[0] for p in (config.run_dir.checkpoints / "superseded").iterdir()] \
        == ["step-00000020"]  # kept, as every committed copy
    assert checkpoints.unjudged_steps(config) == [] and checkpoints.unsecured_steps(config) == []
    assert list(checkpoints.new_checkpoints(config, lambda: False)) == []
    assert _stored_files(store, 20) == before


def test_an_upload_that_finds_a_newer_copy_of_its_step_in_the_store_adopts_it(run, tmp_path):
    """A's upload task ran before A read the store's ledger (the train flow secures what it
    finds on disk while the first attempt starts): the store's newer copy of the same
    trajectory is adopted, not replaced; the store keeps it whole, and its ledger names it."""

    config, _ = run
    store = open_store(str(tmp_path / "store"))
    machine_b = _another_machine_uploads_step_20(config, store, tmp_path)
    theirs = copy_id(machine_b.run_dir.checkpoint(20))
    before = _stored_files(store, 20)

    entry = checkpoints.upload_checkpoint(config, 20, store)
    assert (entry.state, entry.copy_id) == ("uploaded", theirs)
    assert not config.run_dir.checkpoint(20).exists()
    assert _stored_files(store, 20) == before
    pushed = json.loads(store.get_bytes("runs/test/ledger.json"))["entries"]["20"]
    assert (pushed["state"], pushed["copy_id"]) == ("uploaded", theirs)
    assert checkpoints.resume_point(config, store).step == 20


def test_while_a_step_saved_again_replaces_its_store_copy_the_stores_ledger_does_not_name_it(
        run, tmp_path, monkeypatch):
    """This machine saved step 20 again after uploading it (a newer copy: it replaces the
    store's). While the files go up, the store holds a half-replaced step; its ledger no
    longer calls the step uploaded, so no machine resumes from it meanwhile (or after a crash)."""
    config, _ = run
    store = open_store(str(tmp_path / "store"))
    for step in (10, 20):
        checkpoints.validate_checkpoint(config, step)
        checkpoints.upload_checkpoint(config, step, store)
    path = config.run_dir.checkpoint(20)
    manifest = CheckpointManifest.load(path)
    manifest.created_at += 1  # saved again, later
    manifest.save(path)
    assert checkpoints.validate_checkpoint(config, 20).state == "validated"
    seen, upload_dir = [], type(store).upload_dir

    def spy(self, *args, **kwargs):
        seen.append(json.loads(self.get_bytes("runs/test/ledger.json"))["entries"]["20"]["state"])
        return upload_dir(self, *args, **kwargs)

    monkeypatch.setattr(type(store), "upload_dir", spy)
    assert checkpoints.upload_checkpoint(config, 20, store).state == "uploaded"
    assert seen == ["validated"]
    assert CheckpointManifest.model_validate_json(
        store.get_bytes(f"{checkpoint_key('test', 20)}/manifest.json")).created_at == manifest.created_at


def test_a_store_copy_rejected_as_damaged_is_replaced_by_a_good_local_copy_not_adopted(run, tmp_path):
    """B uploaded its copy of step 20; a worker resuming from it found it damaged and the step
    was rejected, but the store still holds its manifest. A's own older copy, good, is judged
    again and uploaded over it: a copy the store's ledger does not call the step's uploaded
    one is never adopted (A's would go aside, and the next resume reject the step again)."""

    from tests.helpers import flip_bytes

    config, _ = run
    store = open_store(str(tmp_path / "store"))
    machine_b = _another_machine_uploads_step_20(config, store, tmp_path)
    key = checkpoint_key("test", 20)
    shard = next(k for k in store.list(key) if k.endswith(".distcp"))
    damaged = tmp_path / "damaged"
    store.get_file(shard, damaged)
    flip_bytes(damaged)
    store.put_file(damaged, shard)
    checkpoints.set_aside_damaged(machine_b, 20, from_store=True, reason=f"{shard}: sha256 differs")
    checkpoints.ledger_of(machine_b).push(store)
    ours = copy_id(config.run_dir.checkpoint(20))

    point = checkpoints.resume_point(config, store)  # A reruns: its copy judged again
    assert (point.step, point.local) == (20, config.run_dir.checkpoint(20))
    entry = checkpoints.upload_checkpoint(config, 20, store)
    assert (entry.state, entry.copy_id) == ("uploaded", ours)
    assert config.run_dir.checkpoint(20).exists()
    assert not (config.run_dir.checkpoints / "superseded").exists()
    stored = store.get_bytes(f"{key}/manifest.json")
    assert stored == (config.run_dir.checkpoint(20) / "manifest.json").read_bytes()
    pushed = json.loads(store.get_bytes("runs/test/ledger.json"))["entries"]["20"]
    assert (pushed["state"], pushed["copy_id"]) == ("uploaded", ours)
    fresh = small_config(tmp_path / "c", "training.max_steps=20")  # a new machine reads it whole
    assert checkpoints.resume_point(fresh, store).step == 20
    store.download_dir(key, tmp_path / "whole")
    assert verify_files(tmp_path / "whole",
                        CheckpointManifest.load(config.run_dir.checkpoint(20)).files) == []


def test_replacing_a_store_copy_uploaded_after_this_one_was_validated_unnames_it_first(
        run, tmp_path, monkeypatch):
    """A validated its copy of step 20; B then uploaded an older copy of it (the store's
    ledger changed after A's verdict). A's upload replaces B's copy: while the files go up the
    store's ledger names A's copy as validated, not B's as uploaded, and at the end the
    ledgers name the copy that was uploaded."""

    config, _ = run
    store = open_store(str(tmp_path / "store"))
    for step in (10, 20):
        assert checkpoints.validate_checkpoint(config, step).state == "validated"
    checkpoints.upload_checkpoint(config, 10, store)
    ours = copy_id(config.run_dir.checkpoint(20))
    machine_b = small_config(tmp_path / "b", "training.max_steps=20")
    assert checkpoints.resume_point(machine_b, store).step == 10
    theirs = machine_b.run_dir.checkpoint(20)
    shutil.copytree(config.run_dir.checkpoint(20), theirs)
    manifest = CheckpointManifest.load(theirs)
    manifest.created_at -= 1  # saved before A's
    manifest.save(theirs)
    assert checkpoints.validate_checkpoint(machine_b, 20).state == "validated"
    assert checkpoints.upload_checkpoint(machine_b, 20, store).copy_id == copy_id(theirs) != ours
    seen, upload_dir = [], type(store).upload_dir

    def spy(self, *args, **kwargs):
        stored = json.loads(self.get_bytes("runs/test/ledger.json"))["entries"]["20"]
        seen.append((stored["state"], stored["copy_id"], kwargs.get("abort_unfinished")))
        return upload_dir(self, *args, **kwargs)

    monkeypatch.setattr(type(store), "upload_dir", spy)
    entry = checkpoints.upload_checkpoint(config, 20, store)
    # (a checkpoint upload, one per step under the run's lease, asks to abort what a killed one left)
    assert seen == [("validated", ours, True)]
    assert (entry.state, entry.copy_id) == ("uploaded", ours)
    assert checkpoints.ledger_of(config).read().entries[20].copy_id == ours
    pushed = json.loads(store.get_bytes("runs/test/ledger.json"))["entries"]["20"]
    assert (pushed["state"], pushed["copy_id"]) == ("uploaded", ours)
    assert store.get_bytes(f"{checkpoint_key('test', 20)}/manifest.json") == \
        (config.run_dir.checkpoint(20) / "manifest.json").read_bytes()


def test_adoption_that_fails_does_not_stop_a_resume_nor_blame_the_ledger(run, tmp_path, monkeypatch, caplog):
    """The store's ledger was read; adopting the copies it names then fails (the store went
    away, or a stored manifest does not read): said as such, and the resume goes on."""
    import logging

    config, _ = run
    store = open_store(str(tmp_path / "store"))
    _another_machine_uploads_step_20(config, store, tmp_path)
    manifest_key = f"{checkpoint_key('test', 20)}/manifest.json"
    get_bytes = type(store).get_bytes

    def gone(self, key):
        if key == manifest_key:
            raise ConnectionError("the store went away")
        return get_bytes(self, key)

    with monkeypatch.context() as patched, caplog.at_level(logging.WARNING, logger="goodput.checkpoints"):
        patched.setattr(type(store), "get_bytes", gone)
        checkpoints.restore_ledger(config, store)
    assert "could not adopt" in caplog.text and "the store went away" in caplog.text
    assert "could not read the ledger" not in caplog.text
    assert checkpoints.ledger_of(config).read().entries[20].state == "uploaded"  # merged
    assert config.run_dir.checkpoint(20).exists()  # not adopted: nothing moved

    # A stored manifest that does not read as one is no copy to adopt: said, nothing moved.
    caplog.clear()
    store.put_bytes(manifest_key, b'{"step": "not a manifest"}')
    with caplog.at_level(logging.WARNING, logger="goodput.checkpoints"):
        checkpoints.restore_ledger(config, store)
    assert "is not a checkpoint manifest" in caplog.text
    assert "could not read the ledger" not in caplog.text
    assert config.run_dir.checkpoint(20).exists()

"""Training on a mixture of sources: the config, the schedule, the loader on real prepared
datasets (local and streamed from the store), and the pipeline end to end."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from core.config import load_config
from core.errors import ConfigError, DataError
from goodput.data import prepare as prep
from storage.manifests import MIXTURE_MANIFEST, DatasetManifest
from storage.store import store_from_config
from tests.test_prepare import make_config, write_source
from training.data import DistributedSampleLoader, MixSchedule, open_training_data
from training.shard_cache import disk_usage
from training.tokenizer import load_tokenizer

WEIGHTS = {"web": 0.6, "code": 0.3, "books": 0.1}


def mix_overrides(root: Path, weights: dict[str, float] = WEIGHTS) -> str:
    listed = ", ".join(f"{{name: {name}, weight: {w}, source: {root / 'src' / name}}}"
                       for name, w in weights.items())
    return f"data.sources=[{listed}]"


def write_sources(root: Path, names, docs: int = 400) -> None:
    """A jsonl corpus per source, each with words of its own (so its samples tell it apart)."""
    for n, name in enumerate(names):
        texts = [f"{name} document {i}: " + " ".join(f"{name}{(i * 7 + j) % 50}" for j in range(20 + i % 30))
                 for i in range(docs + 100 * n)]
        write_source(root / "src" / name, "jsonl", texts)


# -- configuration --------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["data.sources=[{name: a, weight: -0.2, source: x}]"], "data.sources.0.weight: weight -0.2"),
    (["data.sources=[{name: a, weight: 0, source: x}, {name: b, weight: 0, source: y}]"],
     "every weight is 0"),
    (["data.sources=[{name: a, weight: 1, source: x}, {name: a, weight: 1, source: y}]"],
     "names a more than once"),
    (["data.sources=[{name: a, weight: 1, source: x}]",
      "data.stages=[{start_step: 5, weights: {b: 1}}]"], "data.stages[0].weights names b"),
    (["data.sources=[{name: a, weight: 1, source: x}]", "data.stages=[{weights: {a: 1}}]"],
     "exactly one of start_step and start_tokens"),
    (["data.sources=[{name: a, weight: 1, source: x}]",
      "data.stages=[{start_step: 9, weights: {a: 1}}, {start_step: 5, weights: {a: 1}}]"],
     "data.stages[1].start_step=5 does not start after data.stages[0].start_step=9: give the "
     "stages in order"),
    # Named as written (steps, tokens), not in samples; a token count by the step it gives.
    (["data.sources=[{name: a, weight: 1, source: x}]",
      "data.stages=[{start_step: 5, weights: {a: 1}}, {start_tokens: 8000, weights: {a: 1}}]"],
     "data.stages[1].start_tokens=8000 (step 5: the first after them, at 2048 tokens a step) "
     "does not start after data.stages[0].start_step=5"),
    (["data.sources=[{name: a, weight: 1, source: x}]", "data.stages=[{start_step: 1, weights: {a: 1}}]"],
     "data.stages[0].start_step=1 starts the stage at the run's first step, so data.sources' "
     "weights would never be used: put these weights in data.sources instead"),
    (["data.sources=[{name: a, weight: 1, source: x}]", "data.stages=[{start_tokens: 0, weights: {a: 1}}]"],
     "data.stages[0].start_tokens=0 starts the stage at the run's first step"),
    (["data.sources=[{name: a, weight: 1, source: x}]", "training.max_steps=30",
      "data.stages=[{start_step: 40, weights: {a: 1}}]"],
     "data.stages[0].start_step=40 starts after the run's last step (training.max_steps=30), so "
     "its weights would never be used"),
    (["data.stages=[{start_step: 5, weights: {a: 1}}]"], "list the sources with their weights"),
    (["data.source=/corpus", "data.sources=[{name: a, weight: 1, source: x}]"],
     "data.source='/corpus' and data.sources are both set"),
    (["data.sources=[{name: 'a b', weight: 1, source: x}]"], "name a source with letters"),
])
def test_a_mix_that_cannot_be_drawn_is_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


def test_the_mix_and_its_stages_are_part_of_the_run_and_a_mix_of_one_hashes_as_before():
    single = load_config(None, ["data.source=/corpus"])
    assert single.data.mix()[0].source == "/corpus" and single.mix_stages() == [(0, {"default": 1.0})]
    mixed = load_config(None, ["data.sources=[{name: a, weight: 3, source: x}, {name: b, weight: 1, source: y}]"])
    staged = load_config(None, ["data.sources=[{name: a, weight: 3, source: x}, {name: b, weight: 1, source: y}]",
                                "data.stages=[{start_tokens: 10000, weights: {b: 1}}]"])
    assert len({single.config_hash(), mixed.config_hash(), staged.config_hash()}) == 3
    # A stage by tokens starts at the first step after them: 10000 / (8 x 2 x 128) -> step 5.
    assert staged.global_batch == 16 and staged.mix_stages()[1] == (5 * 16, {"a": 0.0, "b": 1.0})
    # A source's own fields override the data section's, the rest are shared.
    one = load_config(None, ["data.text_column=body", "data.max_docs=7",
                             "data.sources=[{name: a, weight: 1, source: x, text_column: content}]"])
    prepared_as = one.source_config(one.data.sources[0]).data
    assert (prepared_as.source, prepared_as.text_column, prepared_as.max_docs) == ("x", "content", 7)
    assert not prepared_as.sources


# -- the schedule ---------------------------------------------------------------------------

def test_every_prefix_of_the_schedule_holds_each_share_to_within_a_sample():
    rng = np.random.default_rng(0)
    for weights in ([0.6, 0.3, 0.1], [1, 1], [0.5, 0.25, 0.25], list(rng.random(5))):
        names = [f"s{i}" for i in range(len(weights))]
        schedule = MixSchedule(names, [(0, dict(zip(names, weights)))])
        sources, indexes = schedule.take(50_000)
        counts = np.cumsum(np.eye(len(names), dtype=np.int64)[sources], axis=0)
        expected = np.arange(1, 50_001)[:, None] * (np.array(weights) / sum(weights))
        assert np.abs(counts - expected).max() < 1.5, weights
        for s in range(len(names)):  # each source's samples are taken in order, none twice
            assert np.array_equal(indexes[sources == s], np.arange(counts[-1, s]))


def test_the_schedule_is_the_same_however_it_is_cut_and_follows_its_stages():
    stages = [(0, {"a": 1, "b": 1}), (10, {"a": 0, "b": 1}), (20, {"a": 3, "b": 1})]
    whole = MixSchedule(["a", "b"], stages).take(40)
    cut = MixSchedule(["a", "b"], stages)
    pieces = [cut.take(n) for n in (3, 7, 1, 12, 17)]
    assert all(np.array_equal(np.concatenate(p), w) for p, w in zip(zip(*pieces), whole))
    sources = whole[0]
    assert list(np.bincount(sources[:10], minlength=2)) == [5, 5]
    assert list(np.bincount(sources[10:20], minlength=2)) == [0, 10]
    assert list(np.bincount(sources[20:], minlength=2)) == [15, 5]
    # Resumed from its state, a schedule continues the same sequence.
    first = MixSchedule(["a", "b"], stages)
    first.take(15)
    resumed = MixSchedule(["a", "b"], stages)
    resumed.load_state_dict(first.position, first.state_dict())
    assert np.array_equal(np.concatenate([sources[:15], resumed.take(25)[0]]), sources)
    with pytest.raises(ConfigError, match="checkpoint data mix was a, b"):
        MixSchedule(["a", "b", "c"], stages).load_state_dict(15, first.state_dict())


def test_errors_about_a_source_of_the_mix_name_its_fields(tmp_path):
    """Not `data.source=...`, a field a mix leaves unset: data.sources[<name>].source, or the
    source's own field to set, also for what is found while its documents are read."""
    write_sources(tmp_path, ["web"])
    web = f"{{name: web, weight: 1, source: {tmp_path / 'src' / 'web'}}}"

    def error(source: str) -> str:
        with pytest.raises(DataError) as err:
            prep.prepare_dataset(make_config(tmp_path, f"data.sources=[{source}, {web}]"))
        assert "data.source=" not in str(err.value)
        return str(err.value)

    nothing = error(f"{{name: code, weight: 1, source: '{tmp_path / 'nothing'}/*.jsonl'}}")
    assert f"(data.sources[code].source='{tmp_path / 'nothing'}/*.jsonl'" in nothing
    assert "or use data.sources[code].source=builtin" in nothing
    blank = write_source(tmp_path / "src" / "blank", "jsonl", ["", "  "])
    empty = error(f"{{name: blank, weight: 1, source: {blank}}}")
    assert f"data.sources[blank].source='{blank}' holds no text" in empty
    assert "check data.sources[blank].text_column" in empty
    body = write_source(tmp_path / "src" / "body", "jsonl", ["some text"] * 20, column="body")
    column = error(f"{{name: body, weight: 1, source: {body}}}")
    assert "set data.sources[body].text_column if the text is in another field" in column


# -- real prepared sources ------------------------------------------------------------------

@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    """Three sources prepared by the library into a local store: (config, mixture manifest)."""
    root = tmp_path_factory.mktemp("mix")
    write_sources(root, WEIGHTS)
    config = make_config(root, mix_overrides(root), "data.max_docs=null", "training.seq_len=32",
                         "data.shard_tokens=4096")
    return config, prep.prepare_dataset(config)


def loader(directory, config, rank=0, ranks=1, micro_batch=4):
    data = open_training_data(directory)
    return DistributedSampleLoader({s.name: s.stream("train") for s in data.sources}, 32, micro_batch,
                                   rank, ranks, seed=3, shuffle_window_tokens=2048,
                                   stages=config.mix_stages())


def test_a_mix_shares_the_first_sources_tokenizer_and_adding_a_source_prepares_only_it(mix, tmp_path):
    config, manifest = mix
    manifests = {s.name: DatasetManifest.load(Path(config.data.data_dir) / s.dataset_id) for s in manifest.sources}
    assert len({m.tokenizer_sha256 for m in manifests.values()}) == 1
    assert manifest.tokenizer_sha256 == manifests["web"].tokenizer_sha256
    before = {p: p.stat().st_mtime_ns for p in Path(config.data.data_dir).glob("*/manifest.json")}
    root = Path(config.data.data_dir).parent
    write_sources(root, ["math"], docs=300)
    bigger = make_config(root, mix_overrides(root, {**WEIGHTS, "math": 0.2}), "data.max_docs=null",
                         "training.seq_len=32", "data.shard_tokens=4096")
    grown = prep.prepare_dataset(bigger)
    assert [s.dataset_id for s in grown.sources[:3]] == [s.dataset_id for s in manifest.sources]
    assert grown.dataset_id != manifest.dataset_id
    after = {p: p.stat().st_mtime_ns for p in Path(config.data.data_dir).glob("*/manifest.json")}
    assert {p: t for p, t in after.items() if p in before} == before and len(after) == len(before) + 1
    # The mix of datasets tokenized differently is refused before anything trains.
    other = DatasetManifest.load(Path(config.data.data_dir) / grown.sources[3].dataset_id)
    other = other.model_copy(update={"tokenizer_sha256": "0" * 64})
    sources = [(s, manifests[s.name]) for s in config.data.sources] + [(bigger.data.sources[3], other)]
    with pytest.raises(ConfigError, match="math .* another tokenizer than web"):
        prep.mixture_manifest(sources)
    # The same tokenizer, but documents that start with a BOS beside ones that do not.
    with_bos = other.model_copy(update={"tokenizer_sha256": manifest.tokenizer_sha256, "doc_prefix_ids": [0]})
    with pytest.raises(ConfigError, match="math .* starts or ends its documents with other tokens"):
        prep.mixture_manifest([(s, manifests[s.name]) for s in config.data.sources] + [(bigger.data.sources[3], with_bos)])


def test_prepare_names_the_mix_directory_training_reads(mix, monkeypatch, tmp_path):
    """`goodput prepare` of a mix prints the directory to give `torchrun -m training
    --dataset` (or `goodput export --tokenizer`): the mix's mixture.json, naming each
    source's dataset here. It used to appear only once a train flow had read the mix."""
    from flows import cli
    from goodput.data.prepare import mixture_dir
    from training.data import open_training_data

    config, manifest = mix
    for name in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))  # no profile names a server
    monkeypatch.chdir(tmp_path)  # nor a settings file
    shutil.rmtree(mixture_dir(config, manifest.dataset_id), ignore_errors=True)
    found = cli._without_a_flow("prepare", config)
    assert found["dataset_id"] == manifest.dataset_id
    assert found["dataset_dir"] == str(mixture_dir(config, manifest.dataset_id))
    data = open_training_data(found["dataset_dir"])
    assert [s.name for s in data.sources] == list(WEIGHTS)
    # A source only in the store: no such directory yet (training makes it, with a cache).
    one = Path(config.data.data_dir) / manifest.sources[0].dataset_id
    shutil.rmtree(mixture_dir(config, manifest.dataset_id))
    moved = tmp_path / "moved"
    shutil.move(one, moved)
    try:
        assert prep.local_dataset_dir(config, manifest) is None
    finally:
        shutil.move(moved, one)


def test_ranks_of_a_mix_together_see_what_one_rank_sees_and_resume_at_another_world_size(mix):
    config, _ = mix
    directory = prep.dataset_for_training(config, store_from_config(config.storage))
    assert (directory / MIXTURE_MANIFEST).is_file()
    one = loader(directory, config)
    alone = [one.next_batch()[0] for _ in range(30)]
    two = [loader(directory, config, rank, 2, micro_batch=2) for rank in range(2)]
    for step in range(12):
        assert np.array_equal(np.concatenate([r.next_batch()[0] for r in two]), alone[step])
    resumed = loader(directory, config, micro_batch=4)
    resumed.load_state_dict(json.loads(json.dumps(two[1].state_dict())))  # as a checkpoint holds it
    for step in range(12, 30):
        assert np.array_equal(resumed.next_batch()[0], alone[step])
    taken = one.state_dict()["taken"]
    assert {name: taken[name] / 120 for name in taken} == pytest.approx(WEIGHTS, abs=1 / 120)
    # Each sample is its source's: its words, no other source's.
    tokenizer = load_tokenizer(open_training_data(directory).tokenizer_path)
    sources, _ = MixSchedule(list(WEIGHTS), config.mix_stages()).take(4 * 30)
    for row, source in zip(np.concatenate(alone), sources):
        text, name = tokenizer.decode(row.tolist()), list(WEIGHTS)[source]
        assert name in text and not any(other in text for other in WEIGHTS if other != name), text


def test_a_rollback_skips_the_same_samples_of_every_source(mix):
    config, _ = mix
    directory = prep.dataset_for_training(config, store_from_config(config.storage))
    straight = loader(directory, config)
    batches = [straight.next_batch()[0] for _ in range(20)]
    rolled = loader(directory, config)
    rolled.skip_windows([(4 * 5, 4 * 9)])  # the samples of batches 5..8, never handed out
    assert all(np.array_equal(rolled.next_batch()[0], batches[i]) for i in [*range(5), *range(9, 20)])
    assert rolled.state_dict()["taken"] == straight.state_dict()["taken"]


def test_a_mix_streams_from_the_store_within_its_cache_limit(mix, tmp_path):
    config, manifest = mix
    local = prep.dataset_for_training(config, store_from_config(config.storage))
    expected = loader(local, config)
    batches = [expected.next_batch()[0] for _ in range(60)]
    moved = tmp_path / "elsewhere"  # another machine: the datasets only in the store
    streamed_config = make_config(moved, mix_overrides(Path(config.data.data_dir).parent),
                                  "data.max_docs=null", "training.seq_len=32", "data.shard_tokens=4096",
                                  f"storage.uri={config.storage.uri}", "data.cache_limit=160KiB",
                                  "training.shuffle_window_tokens=2048")
    shutil.copytree(Path(config.data.data_dir).parent / "src", moved / "src")
    directory = prep.dataset_for_training(streamed_config, store_from_config(streamed_config.storage))
    mixture = json.loads((directory / MIXTURE_MANIFEST).read_text())
    caches = [Path(s["dir"]) for s in mixture["sources"]]
    assert all(c.parent.name == "cache" for c in caches)
    streamed = loader(directory, streamed_config)
    for batch in batches:
        assert np.array_equal(streamed.next_batch()[0], batch)
        assert sum(disk_usage(c) for c in caches) <= 160 * 1024
    # A shard that vanished from the store is an error naming it, never a skip.
    store = store_from_config(streamed_config.storage)
    web = manifest.sources[0].dataset_id
    missing = next(s.path for s in DatasetManifest.load(caches[0]).splits["train"]
                   if not (caches[0] / s.path).exists())
    store.delete(f"datasets/{web}/{missing}")
    with pytest.raises(DataError, match=missing) as vanished:
        for _ in range(400):
            streamed.next_batch()


def test_training_logs_each_stage_and_records_the_samples_drawn_from_each_source(mix):
    """Where the mix changes, the log says so; every metrics record carries the samples drawn
    from each source so far (the realized shares), and the run's summary the shares at its
    newest checkpoint."""
    from goodput.accounting import mix_drawn, mix_drawn_by_stage
    from tests.helpers import torchrun_training
    from training.metrics import read_metrics

    config, _ = mix
    staged = make_config(Path(config.data.data_dir).parent, mix_overrides(Path(config.data.data_dir).parent),
                         "data.max_docs=null", "training.seq_len=32", "data.shard_tokens=4096",
                         "data.stages=[{start_step: 5, weights: {code: 1}}]", "run.run_id=staged",
                         "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=64",
                         "training.micro_batch_size=4", "training.max_steps=8",
                         "training.warmup_steps=2", "checkpoint.every_steps=8", "launch.max_restarts=0",
                         "training.log_every=3")
    directory = prep.dataset_for_training(staged, store_from_config(staged.storage))
    proc = torchrun_training(staged, directory)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "[data] mix stage 0 of 1 from step 1 on: weights {'web': 0.6, 'code': 0.3, 'books': 0.1}" in output
    assert "[data] mix stage 1 from step 5 on: weights {'code': 1.0}" in output
    drawn = {r["step"]: {k.removeprefix("samples/"): v for k, v in r.items() if k.startswith("samples/")}
             for r in read_metrics(staged.run_dir)}
    batch = 4 * 2  # micro-batch x 2 ranks
    assert all(sum(counts.values()) == step * batch for step, counts in drawn.items())
    assert drawn[4] == {"web": 19, "code": 10, "books": 3}  # 0.6 / 0.3 / 0.1 of 32, to a sample
    assert drawn[8] == {"web": 19, "code": 10 + 4 * batch, "books": 3}  # then code alone
    assert mix_drawn(staged.run_dir, 8) == {"web": {"samples": 19, "share": 0.2969},
                                            "code": {"samples": 42, "share": 0.6562},
                                            "books": {"samples": 3, "share": 0.0469}}
    # A checkpoint between two records (training.log_every) takes the one before it.
    assert mix_drawn(staged.run_dir, 9) == mix_drawn(staged.run_dir, 8)
    # Within each stage, what was drawn against that stage's weights (the summary's figure).
    assert mix_drawn_by_stage(staged.run_dir, 8, staged.mix_stages(), staged.global_batch) == [
        {"stage": 0, "steps": [1, 4], "weights": {"web": 0.6, "code": 0.3, "books": 0.1},
         "drawn": {"web": {"samples": 19, "share": 0.5938}, "code": {"samples": 10, "share": 0.3125},
                   "books": {"samples": 3, "share": 0.0938}}},
        {"stage": 1, "steps": [5, 8], "weights": {"web": 0.0, "code": 1.0, "books": 0.0},
         "drawn": {"web": {"samples": 0, "share": 0.0}, "code": {"samples": 32, "share": 1.0},
                   "books": {"samples": 0, "share": 0.0}}}]
    # The record at a stage's last step is written whatever training.log_every says.
    assert [r["step"] for r in read_metrics(staged.run_dir)] == [3, 4, 6, 8]


# -- the pipeline ---------------------------------------------------------------------------

@pytest.mark.slow  # about 3.5 min; the mixing itself is tested above, the pipeline by tests/test_pipeline
def test_a_mix_of_three_sources_through_the_pipeline_and_a_resume_at_another_layout(prefect_api, tmp_path):
    from flows.pipeline import pipeline
    from flows.train import train
    from tests.helpers import losses_by_step, small_config

    write_sources(tmp_path, WEIGHTS)
    mixed = (mix_overrides(tmp_path), "data.max_docs=null",
             "data.stages=[{start_step: 16, weights: {web: 1, books: 1}}]")
    config = small_config(tmp_path, *mixed, "checkpoint.validate_batches=2")
    result = pipeline(config)
    summary = json.loads((config.run_dir / "summary.json").read_text())
    assert result["final_step"] == 30 and summary["prepare"]["dataset_id"] == result["dataset_id"]
    assert set(summary["prepare"]["sources"]) == set(WEIGHTS)
    losses = summary["evaluate"]["source_losses"]
    assert set(losses) == set(WEIGHTS)
    assert summary["evaluate"]["loss"] == pytest.approx(sum(WEIGHTS[n] * losses[n] for n in losses))
    # The same run on two ranks crashes at step 25; resumed on one rank (two micro-steps a
    # step: the same global batch) from step 20, it sees the same samples: the same losses.
    crashed = small_config(tmp_path, *mixed, "run.run_id=relayout", "faults.crash_at_step=25",
                           "run.max_attempts=1")
    with pytest.raises(Exception):
        train(crashed)
    assert max(losses_by_step(crashed.run_dir)) == 25
    one_rank = small_config(tmp_path, *mixed, "run.run_id=relayout", "parallelism.nproc_per_node=1",
                            "training.grad_accum_steps=2")
    assert one_rank.config_hash() == crashed.config_hash()
    train(one_rank)
    expected, resumed = losses_by_step(config.run_dir), losses_by_step(one_rank.run_dir)
    assert [resumed[s] for s in range(21, 31)] == pytest.approx([expected[s] for s in range(21, 31)], rel=1e-3)


def test_checkpoint_validation_weighs_the_mix_as_the_checkpoints_step_was_trained(mix):
    """After a curriculum stage the training loss is drawn under the stage's weights; the
    held-out loss the validator compares it with is weighted the same, not by data.sources'
    (which rejected every checkpoint after a stage that moved the mix to an easier source)."""
    import torch

    from core.config import StageConfig
    from goodput.checkpoint_lifecycle import held_out_check
    from training.held_out import mix_held_out_loss
    from training.model import Transformer, model_args_from_config

    config, _ = mix
    stage = StageConfig(start_step=5, weights={"code": 1.0})
    staged = config.model_copy(update={
        "data": config.data.model_copy(update={"stages": [stage]}),
        "checkpoint": config.checkpoint.model_copy(update={"validate_batches": 2})})
    directory = prep.dataset_for_training(config, store_from_config(config.storage))

    def weights(step):
        args = held_out_check(staged, directory, step)
        return json.loads(args[args.index("--mix-weights") + 1])

    assert weights(4) == WEIGHTS and weights(5) == {"web": 0.0, "code": 1.0, "books": 0.0}
    assert "--mix-weights" not in held_out_check(config, directory, 5)  # no stages: the sources' weights

    data = open_training_data(directory)
    torch.manual_seed(0)
    model = Transformer(model_args_from_config(config.model, load_tokenizer(data.tokenizer_path).get_vocab_size())).eval()
    first, _, per_source = mix_held_out_loss(model, data, 32, 4, 2, torch.device("cpu"))
    after, _, _ = mix_held_out_loss(model, data, 32, 4, 2, torch.device("cpu"), weights(5))
    assert after == pytest.approx(per_source["code"]) and after != pytest.approx(first)
    assert first == pytest.approx(sum(WEIGHTS[name] * loss for name, loss in per_source.items()))

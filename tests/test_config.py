"""RunConfig: YAML + overrides, and errors that name the field and the fix."""

import importlib.util
import re
import shutil
import sys

import pytest
import yaml

from core.config import ConfigError, RunConfig, config_from_dict, dump_config, load_config
from core.files import sha256_file
from goodput.runs import write_run_config
from storage.store import store_from_config


def test_tiny_yaml_is_the_builtin_default():
    assert load_config("configs/tiny.yaml") == RunConfig()


def test_overrides_parse_as_yaml_values():
    config = load_config("configs/tiny.yaml", ["training.max_steps=50", "training.lr=1e-3",
                                               "storage.uri=s3://bucket/prefix", "data.max_docs=null"])
    assert config.training.max_steps == 50
    assert config.training.lr == pytest.approx(1e-3)
    assert config.storage.uri == "s3://bucket/prefix"
    assert config.data.max_docs is None


@pytest.mark.parametrize("override, field, hint", [
    ("model.n_heads=3", "model", "n_heads=3 does not divide dim=128"),
    ("training.max_steps=0", "training.max_steps", "greater than or equal to 1"),
    ("training.seq_len=512", None, "raise model.max_seq_len"),
    ("training.max_stepz=5", "training.max_stepz", "unknown field"),
    ("training.max_steps=20", None, "training.warmup_steps=20 must be below training.max_steps=20: "
     "lower training.warmup_steps (e.g. training.warmup_steps=2) or raise training.max_steps"),
    ("model.n_kv_heads=3", "model", "n_kv_heads=3 does not divide n_heads=4"),
    ("run.run_id=bad/id", "run.run_id", "should match pattern"),
    ("training.lr=fast", "training.lr", "valid number"),
    ("training.lr=inf", "training.lr", "finite number"),  # passed gt=0, trained NaN losses
    ("run.runs_dir=README.md", "run.runs_dir", "README.md is a file, not a directory"),
    ("data.data_dir=README.md", "data.data_dir", "README.md is a file, not a directory"),
    ("eval.tasks=capitals,llcont", "eval.tasks", "give a list in brackets: 'eval.tasks=[capitals, llcont]'"),
    ("faults.crash_rank=5", None, "faults.crash_rank=5 is not a rank"),
    ("storage.part_size=1MiB", "storage.part_size", "outside what S3 accepts; choose 5MiB to 5GiB"),
    ("storage.part_size=lots", "storage.part_size", "'lots' is not a memory size"),
    ("storage.max_concurrency=0", "storage.max_concurrency", "greater than or equal to 1"),
    ("storage.uri=s3://ab/runs", "storage.uri", "invalid S3 bucket name 'ab'"),
    ("storage.uri=s3://My_Bucket", "storage.uri", "use 3 to 63 lowercase letters"),
    ("storage.uri=s3://bucket/runs/../x", "storage.uri", "invalid key 'runs/../x'"),
    ("run.retry_budgets.retriable=3", "run.retry_budgets", "unknown failure class(es) ['retriable']"),
    ("run.retry_budgets.hang=-1", "run.retry_budgets", "['hang'] below 0"),
    ("parallelism.tp=2 training.seq_len=127", None,
     "tp=2 does not divide training.seq_len=127, which sequence parallelism splits over the TP "
     "ranks; choose tp in [1], or a seq_len divisible by 2, e.g. 128"),
    ("model.rope_scaling.factor=8 model.rope_scaling.low_freq_factor=4 "
     "model.rope_scaling.high_freq_factor=1 model.rope_scaling.original_max_position_embeddings=8192",
     "model.rope_scaling", "high_freq_factor=1.0 must exceed low_freq_factor=4.0"),
    ("model.rope_scaling.factor=8", "model.rope_scaling.low_freq_factor", "Field required"),
    ("model.ffn_dim_multiplier=0", "model.ffn_dim_multiplier", "greater than 0"),
    ("parallelism.compile_mode=fast", "parallelism.compile_mode", "'reduce-overhead'"),
    ("parallelism.compile=true parallelism.compile_mode=reduce-overhead parallelism.dp_shard=-1 "
     "parallelism.nproc_per_node=2", "parallelism", "not with dp_shard=-1 (2 here): their hooks"),
    ("parallelism.compile=true parallelism.compile_mode=max-autotune training.grad_accum_steps=2",
     None, "the next micro-batch's graph would write over the gradients kept from the last"),
    ("parallelism.compile=true parallelism.compile_mode=reduce-overhead model.moe.num_experts=4 "
     "model.moe.top_k=2", None, "(CUDA graphs) with model.moe"),
    ("model.tie_embeddings=true parallelism.pp=2 training.micro_batch_size=4", None,
     "model.tie_embeddings=true shares the embedding matrix with the output layer, but pp=2 puts "
     "them on different pipeline stages; set parallelism.pp=1"),
    ("parallelism.pp=2 parallelism.pp_schedule=interleaved-1f1b parallelism.microbatches=5 "
     "training.micro_batch_size=5", None,
     "microbatches=5 do not split into equal rounds of interleaved-1f1b over pp=2"),
])
def test_invalid_values_name_the_field(override, field, hint):
    """None: a check across sections, whose message names the fields itself."""
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.yaml", override.split())
    assert f"{field}:" in str(err.value) if field else "(top level)" not in str(err.value)
    assert hint in str(err.value)


def test_dp_shard_minus_one_takes_the_rest_from_the_default_dp_replicate():
    """configs/llama2-7b.yaml's own example: dp_replicate's default (-1) gives way."""
    config = load_config("configs/llama2-7b.yaml", ["parallelism.dp_shard=-1", "parallelism.tp=8"])
    assert config.parallelism.degrees() == {"dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 8, "pp": 1}
    # The same through a full dump, as a Prefect form or a saved run config carries it.
    dumped = config_from_dict({**RunConfig().model_dump(), "parallelism": {
        **RunConfig().parallelism.model_dump(), "dp_shard": -1}})
    assert dumped.parallelism.degrees() == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "pp": 1}


def test_a_retry_budget_given_overrides_only_its_class():
    budgets = load_config(None, ["run.retry_budgets.retryable=10"]).run.retry_budgets
    assert budgets == {**RunConfig().run.retry_budgets, "retryable": 10}
    assert budgets["hang"] == 2


def test_storage_transfer_settings_reach_the_s3_store():
    config = load_config("configs/tiny.yaml", ["storage.uri=s3://bucket/runs", "storage.region=us-east-1",
                                               "storage.part_size=64MiB", "storage.max_concurrency=32"])
    store = store_from_config(config.storage)
    assert store.transfer.multipart_chunksize == store.transfer.multipart_threshold == 64 * 2**20
    assert store.transfer.max_request_concurrency == store.transfer.max_in_memory_upload_chunks == 32


def test_an_override_value_is_never_cut_short_by_a_yaml_comment():
    """'#' after a space starts a YAML comment: `run.runs_dir=/x/my runs #2` would quietly
    become '/x/my runs'. It is refused with the quoting that keeps it; '#' elsewhere is kept."""
    with pytest.raises(ConfigError, match=r"""read as a YAML comment.*'run.runs_dir="/x/my runs #2"'"""):
        load_config(None, ["run.runs_dir=/x/my runs #2"])
    assert str(load_config(None, ['run.runs_dir="/x/my runs #2"']).run.runs_dir) == "/x/my runs #2"
    assert str(load_config(None, ["run.runs_dir=/x/runs#2"]).run.runs_dir) == "/x/runs#2"


def test_malformed_override_and_missing_file():
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(None, ["training.max_steps"])
    with pytest.raises(ConfigError, match="not found"):
        load_config("configs/nope.yaml")
    # An item of a list (data.stages, data.sources) by index, either way of writing it.
    for override in ("data.stages[0].start_step=200", "data.stages.0.start_step=200"):
        with pytest.raises(ConfigError, match=re.escape(
                f"override '{override}': an item of a list is not overridden on its own; give "
                "the whole list, e.g. 'data.stages=[{...}, {...}]'")):
            load_config(None, [override])


def test_yaml_that_is_not_a_mapping(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(bad)


def test_a_config_file_given_without_config_is_pointed_to_it():
    with pytest.raises(ConfigError, match="to read a config file, give it as --config configs/tiny.yaml"):
        load_config(None, ["configs/tiny.yaml"])
    with pytest.raises(ConfigError, match="must look like section.field=value"):
        load_config(None, ["training.max_steps"])


def test_a_key_given_twice_or_a_file_not_text_is_an_error_naming_it(tmp_path):
    """A second `run:` section silently replaced the first; a binary file gave a traceback."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("run:\n  run_id: a\ntraining:\n  max_steps: 5\nrun:\n  run_id: b\n")
    with pytest.raises(ConfigError, match=r"key 'run' is given twice \(first on line 1\)"):
        load_config(twice)
    merged = tmp_path / "merged.yaml"  # YAML merge keys are meant to be overridden
    merged.write_text("base: &b {max_steps: 5, lr: 0.001}\ntraining:\n  <<: *b\n  max_steps: 7\n")
    with pytest.raises(ConfigError, match="base"):  # an unknown section, but read whole
        load_config(merged)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="binary.yaml is not UTF-8 text"):
        load_config(binary)


def test_config_hash_ignores_paths_and_faults():
    base = load_config(None)
    # model.max_seq_len too: only the RoPE table's length (a run started with --config FILE
    # model.init_from=DIR before that took the checkpoint's context continues).
    moved = load_config(None, ["run.runs_dir=/elsewhere", "faults.crash_at_step=3", "data.data_dir=/d",
                               "storage.uri=s3://bucket/p", "model.max_seq_len=4096"])
    changed = load_config(None, ["training.lr=1e-4"])
    assert base.config_hash() == moved.config_hash()
    assert base.config_hash() != changed.config_hash()


def test_tokenizer_path_is_made_absolute_and_the_hash_follows_its_file_not_its_place(tmp_path, monkeypatch):
    """A relative tokenizer.path means the file from where the config was read, for every node
    and later command; the run is tied to the tokenizer's bytes, so it may move."""
    given = tmp_path / "here" / "tok.json"
    given.parent.mkdir()
    given.write_text('{"model": "one"}')
    monkeypatch.chdir(given.parent)
    config = load_config(None, ["tokenizer.path=tok.json"])
    assert config.tokenizer.path == str(given) and config.tokenizer.sha256 == sha256_file(given)
    saved = dump_config(config)
    monkeypatch.chdir(tmp_path)
    moved = tmp_path / "there" / "tok.json"
    moved.parent.mkdir()
    shutil.move(given, moved)
    # The saved config loads without the file (it keeps the sha256), as the same run.
    again = config_from_dict(yaml.safe_load(saved))
    assert again == config and again.config_hash() == config.config_hash()
    assert load_config(None, [f"tokenizer.path={moved}"]).config_hash() == config.config_hash()
    moved.write_text('{"model": "another"}')
    assert load_config(None, [f"tokenizer.path={moved}"]).config_hash() != config.config_hash()


def test_a_saved_run_config_that_no_longer_loads_is_a_config_error(tmp_path):
    """write_run_config compares with the run's config.yaml: one that does not validate (edited,
    or written by another version) is a ConfigError naming the file and the field."""
    config = load_config(None, [f"run.runs_dir={tmp_path}"])
    path = write_run_config(config)
    path.write_text(path.read_text().replace("max_steps: 300", "max_steps: 0"))
    with pytest.raises(ConfigError, match=r"(?s)its saved config no longer loads.*"
                                          r"training.max_steps: Input should be greater.*Fix that in"):
        write_run_config(config)


def test_a_run_with_another_trajectory_names_what_differs_and_how_to_reuse_its_config(tmp_path):
    """`goodput train training.max_steps=600` (or evaluate) on a run trained to 300: the error
    names the field and says how to continue or evaluate that run, not only to start another."""
    run = [f"run.runs_dir={tmp_path}"]
    saved = write_run_config(load_config(None, [*run, "training.max_steps=600"]))
    with pytest.raises(ConfigError) as err:
        write_run_config(load_config(None, run))
    assert "training.max_steps: 600 in the run, 300 here" in str(err.value)
    assert f"--config {saved}" in str(err.value)


@pytest.mark.parametrize("override, package", [("tracking.wandb_project=pretrain", "wandb"),
                                               ("tracking.mlflow_uri=http://mlflow:5000", "mlflow")])
def test_a_tracker_whose_package_is_missing_is_refused_naming_the_extra(monkeypatch, override, package):
    """Not a ModuleNotFoundError on rank 0 after the model is built, retried to no end."""
    field = override.split("=")[0]
    monkeypatch.setitem(sys.modules, package, None)  # `import <package>` fails, as uninstalled
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert f"{field}: {field.split('.')[1]}=" in str(err.value)
    assert f"needs the {package} package" in str(err.value)
    assert "pip install -e '.[tracking]'" in str(err.value)
    monkeypatch.delitem(sys.modules, package)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == package else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[tracking\]'"):
        load_config(None, [override])
    # Installed (whether or not it is on this machine): accepted.
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == package else find_spec(name, *a))
    load_config(None, [override])


def test_data_settings_of_the_old_shape_say_what_replaced_them():
    with pytest.raises(ConfigError, match="data.num_shards is gone.*data.shard_tokens"):
        load_config(None, ["data.num_shards=4"])
    with pytest.raises(ConfigError, match="data.unit_bytes: '12x' is not a memory size"):
        load_config(None, ["data.unit_bytes=12x"])


def test_llama3_fields_default_to_llama2_behaviour():
    """Configs and checkpoints written before ffn_dim_multiplier, rope_scaling and
    tie_embeddings existed mean the same model: the defaults change nothing."""
    from training.model import ModelArgs, model_args_from_config

    model = RunConfig().model
    assert (model.ffn_dim_multiplier, model.ffn_hidden_dim, model.rope_scaling, model.tie_embeddings,
            model.vocab_size, model.init_from) == (None, None, None, False, None, None)
    args = model_args_from_config(model, 4000)
    assert args.vocab_size == 4096 and args.ffn_hidden == 352  # int(8 * 128 / 3) = 341 -> 352
    old_manifest = {"vocab_size": 4096, "dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": None,
                    "ffn_multiple_of": 32, "norm_eps": 1e-5, "rope_theta": 10000.0, "max_seq_len": 256}
    assert ModelArgs(**old_manifest) == args


@pytest.mark.parametrize("uri", ["./mlruns", "mlruns", "/srv/mlruns", "file:///srv/mlruns"])
def test_an_mlflow_directory_store_is_refused_naming_what_works(monkeypatch, uri):
    """MLflow 3 refuses a directory store at its first call, so every record was lost while
    training went on; a database or a server is what it records to."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ConfigError, match=r"tracking.mlflow_uri: mlflow_uri=.* is a directory, "
                                          r"which MLflow 3 no longer records to; give a database "
                                          r"\(sqlite:///mlflow.db\)"):
        load_config(None, [f"tracking.mlflow_uri={uri}"])
    for fine in ("sqlite:///mlflow.db", "http://mlflow:5000", "databricks", "databricks-uc",
                 "databricks://profile"):
        load_config(None, [f"tracking.mlflow_uri={fine}"])
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's own way to keep one
    load_config(None, [f"tracking.mlflow_uri={uri}"])


def test_a_missing_config_file_is_named_with_where_it_was_looked_for(tmp_path, monkeypatch):
    """A flow run reads a relative config_file where it runs ($GOODPUT_REPO on a worker)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"config file configs/tinyy.yaml not found \(in {tmp_path}\); "
                                          r"pass an existing YAML file"):
        load_config("configs/tinyy.yaml")


@pytest.mark.parametrize("overrides, says, not_says", [
    # Stages beyond the layers: only the fixes that apply (no schedule advice without
    # interleaving).
    ("parallelism.dp_replicate=1 parallelism.pp=2 parallelism.pp_schedule=1f1b model.n_layers=1",
     "2 pipeline stages (pp=2, 1f1b) exceed n_layers=1: each stage needs at least one layer; set "
     "parallelism.pp=1, or raise model.n_layers to 2 or more", "pp_schedule"),
    ("parallelism.dp_replicate=1 parallelism.pp=2 parallelism.pp_schedule=interleaved-1f1b "
     "parallelism.pp_virtual_stages=3 model.n_layers=4 training.micro_batch_size=4",
     "6 pipeline stages (pp=2, interleaved-1f1b) exceed n_layers=4: each stage needs at least one "
     "layer; set parallelism.pp=1, or parallelism.pp_virtual_stages to 2 or less, or use a "
     "non-interleaved parallelism.pp_schedule (1f1b or gpipe: one stage per pipeline rank), or "
     "raise model.n_layers to 6 or more", None),
    # TP and heads: only the head count tp does not divide, by its full name.
    ("parallelism.nproc_per_node=4 parallelism.dp_replicate=1 parallelism.tp=4 model.n_kv_heads=2",
     "parallelism.tp=4 does not divide model.n_kv_heads=2: each tensor-parallel rank holds whole "
     "attention heads; choose parallelism.tp in [1, 2]", "model.n_heads"),
    ("parallelism.nproc_per_node=8 parallelism.dp_replicate=1 parallelism.tp=8",
     "parallelism.tp=8 does not divide model.n_heads=4: each tensor-parallel rank holds whole "
     "attention heads; choose parallelism.tp in [1, 2, 4]", "n_kv_heads"),
    # Degrees whose product does not divide the world: named, with the values that fit.
    ("parallelism.tp=3", "parallelism.tp=3 (the degrees given; parallelism.dp_replicate=-1 takes "
     "the rest) does not divide world size 2 (nnodes x nproc_per_node); choose parallelism.tp in "
     "[1, 2], or change the world size", "product of the fixed degrees"),
    ("parallelism.nproc_per_node=8 parallelism.tp=2 parallelism.pp=3",
     "parallelism.tp=2 x parallelism.pp=3 = 6 (the degrees given; parallelism.dp_replicate=-1 "
     "takes the rest) does not divide world size 8 (nnodes x nproc_per_node); choose "
     "parallelism.pp in [1, 2, 4], or change the world size", None),
    # A reversed node range is said to be one, not blamed on a field the user never set.
    ("parallelism.nnodes=3:2", "parallelism.nnodes=3:2 is a reversed range: give it as MIN:MAX, "
     "fewest nodes first (parallelism.nnodes=2:3)", "elastic.min_nodes"),
    # A micro-batch that does not split into the pipeline micro-batches: either side may change.
    ("parallelism.dp_replicate=1 parallelism.pp=2 training.micro_batch_size=6",
     "training.micro_batch_size=6 does not split into 4 pipeline micro-batches "
     "(parallelism.microbatches' default 2*pp=4); set training.micro_batch_size to a multiple of "
     "4 (e.g. 8), or parallelism.microbatches to one of [2, 3, 6] (the divisors of "
     "training.micro_batch_size=6 that pp_schedule=1f1b runs); fewer than 2*pp=4 micro-batches "
     "run, with a larger pipeline bubble", None),
    ("parallelism.dp_replicate=1 parallelism.pp=2 training.micro_batch_size=1",
     "training.micro_batch_size=1 does not split into 4 pipeline micro-batches "
     "(parallelism.microbatches' default 2*pp=4); set training.micro_batch_size to a multiple of "
     "4 (e.g. 4), or parallelism.microbatches=2 (pp_schedule=1f1b needs at least pp) with "
     "training.micro_batch_size a multiple of 2", None),
    ("parallelism.dp_replicate=1 parallelism.pp=2 parallelism.pp_schedule=gpipe "
     "parallelism.microbatches=4 training.micro_batch_size=2",
     "training.micro_batch_size=2 does not split into 4 pipeline micro-batches "
     "(parallelism.microbatches); set training.micro_batch_size to a multiple of 4 (e.g. 4), or "
     "parallelism.microbatches to one of [1, 2] (the divisors of training.micro_batch_size=2)",
     None),
])
def test_layout_errors_offer_only_the_fixes_that_apply(overrides, says, not_says):
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.yaml", overrides.split())
    assert says in str(err.value)
    assert not_says is None or not_says not in str(err.value)


def test_an_init_from_override_displaces_the_files_model_moe(tmp_path):
    """`--config configs/tiny-moe.yaml model.init_from=MIXTRAL`: the file's experts and routing
    (8 experts of 176, a dense first block) give way to the checkpoint's as its dim and
    n_layers do; its balancing settings stay. model.moe fields given as overrides too must
    agree with the checkpoint, and a dense checkpoint drops the file's model.moe."""
    transformers = pytest.importorskip("transformers")
    from training.tokenizer import train_tokenizer

    mixtral = tmp_path / "mixtral"
    transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=256)).save_pretrained(mixtral)
    train_tokenizer(["the quick brown fox jumps over the lazy dog"] * 20, vocab_size=4096,
                    min_frequency=1).save(str(mixtral / "tokenizer.json"))
    model = load_config("configs/tiny-moe.yaml", [f"model.init_from={mixtral}"]).model
    assert (model.dim, model.n_layers) == (64, 2)
    moe = model.moe
    assert (moe.num_experts, moe.top_k, moe.expert_dim, moe.first_dense_layers) == (4, 2, 128, 0)
    assert (moe.bias_update_rate, moe.aux_loss_coeff) == (1e-3, 1e-3)  # the file's own
    for override, message in (("model.moe.num_experts=8", "model.moe.num_experts=8 but the checkpoint's is 4"),
                              ("model.moe.first_dense_layers=1",
                               "model.moe.first_dense_layers=1 but the checkpoint's is 0")):
        with pytest.raises(ConfigError) as err:
            load_config("configs/tiny-moe.yaml", [f"model.init_from={mixtral}", override])
        assert message in str(err.value) and "leave these fields out" in str(err.value)
        assert str(err.value).count(" but ") == 1  # only the override, not the file's fields
    # The same fields stated in agreement pass.
    load_config("configs/tiny-moe.yaml", [f"model.init_from={mixtral}", "model.moe.num_experts=4"])
    llama = tmp_path / "llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=256)).save_pretrained(llama)
    shutil.copy(mixtral / "tokenizer.json", llama / "tokenizer.json")
    dense = load_config("configs/tiny-moe.yaml", [f"model.init_from={llama}", "parallelism.ep=1"])
    assert dense.model.moe is None
    with pytest.raises(ConfigError, match="model.moe is set but the checkpoint is a dense Llama"):
        load_config("configs/tiny-moe.yaml", [f"model.init_from={llama}", "model.moe.top_k=2"])


@pytest.mark.parametrize("override, says", [
    ("training.max_step=5", "training.max_step: unknown field; did you mean training.max_steps?"),
    ("trainig.max_steps=5", "trainig: unknown field; did you mean training?"),
    ("lr=3e-4", "lr: unknown field; did you mean training.lr?"),
    ("model.moe.num_expert=8", "model.moe.num_expert: unknown field; did you mean "
                               "model.moe.num_experts?"),
    ("global_batch_size=256", "global_batch_size: unknown field; the global batch is "
                              "training.micro_batch_size x training.grad_accum_steps x the "
                              "data-parallel degree"),
    ("training.global_batch=256", "training.global_batch: unknown field; the global batch is "
                                  "training.micro_batch_size x training.grad_accum_steps"),
])
def test_a_misspelled_field_is_answered_with_the_closest_real_one(override, says):
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.yaml", [override])
    assert says in str(err.value)
    assert "goodput show-config" in str(err.value)  # the whole tree; configs/tiny.yaml lacks most


def test_a_misspelled_field_in_a_file_is_answered_the_same_way(tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text("training:\n  max_step: 5\nlr: 0.001\n")
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert "training.max_step: unknown field; did you mean training.max_steps?" in str(err.value)
    assert "lr: unknown field; did you mean training.lr?" in str(err.value)


def test_a_config_directory_is_named_as_one(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config("configs")
    assert "configs is a directory" in str(err.value) and "not found" not in str(err.value)
    assert "give a YAML file in it" in str(err.value) and "configs/tiny.yaml" in str(err.value)


def test_a_slurm_time_limit_is_taken_in_sbatch_forms_and_refused_in_others(tmp_path):
    """`time: 30` is 30 minutes to sbatch (it was refused: "Input should be a valid string");
    a form sbatch refuses was found only when the job was submitted."""
    config = tmp_path / "slurm.yaml"
    config.write_text("launch:\n  kind: slurm\n  slurm:\n    time: 30\n")
    assert load_config(config).launch.slurm.time == "30"
    for given in ("1:00:00", "2-12", "2-12:30:00", "45:00", "UNLIMITED", "0"):
        assert load_config(None, [f"launch.slurm.time={given}"]).launch.slurm.time == given
    with pytest.raises(ConfigError, match=r"launch.slurm.time: 'banana' is not a Slurm time limit: "
                                          r"write minutes \(30\), hours:minutes:seconds"):
        load_config(None, ["launch.slurm.time=banana"])


@pytest.mark.parametrize("kind", ["slurm", "kubernetes"])
def test_the_gpus_a_node_requests_are_its_workers(kind):
    """4 GPUs requested for 2 workers per node left two idle, without a word."""
    where = [f"launch.kind={kind}"] + ([
        "launch.kubernetes.image=goodput:1", "launch.kubernetes.volume_claim=runs",
        "run.runs_dir=/goodput/runs", "data.data_dir=/goodput/data"] if kind == "kubernetes" else [])
    with pytest.raises(ConfigError, match=rf"launch.{kind}.gpus_per_node=4 but "
                                          r"parallelism.nproc_per_node=2: each node runs one "
                                          r"worker per GPU; set parallelism.nproc_per_node=4"):
        load_config(None, [*where, f"launch.{kind}.gpus_per_node=4"])
    assert load_config(None, [*where, f"launch.{kind}.gpus_per_node=2"])
    # Not launched there: the section's GPUs are not asked for.
    assert load_config(None, [f"launch.{kind}.gpus_per_node=4"]).launch.kind == "local"


def test_an_s3_endpoint_without_its_scheme_is_refused_with_the_config():
    """boto3 refused it only once a stage opened the store ("Invalid endpoint")."""
    with pytest.raises(ConfigError, match=r"storage.endpoint_url: '127.0.0.1:8333' is not an S3 "
                                          r"endpoint URL: write it with its scheme"):
        load_config(None, ["storage.endpoint_url=127.0.0.1:8333"])
    with pytest.raises(ConfigError, match=r"'http://127.0.0.1:99999' is not a URL \(Port out of range"):
        load_config(None, ["storage.endpoint_url=http://127.0.0.1:99999"])
    for url in ("http://127.0.0.1:8333", "https://s3.example.com/path", "http://[::1]:8333"):
        assert load_config(None, [f"storage.endpoint_url={url}"]).storage.endpoint_url == url


def test_cuda_graph_modes_are_checked_only_where_they_run():
    # compile_mode is torch.compile's: without parallelism.compile it is not used at all.
    sharded = ["parallelism.dp_shard=2", "parallelism.nproc_per_node=2"]
    assert not load_config("configs/tiny.yaml", ["parallelism.compile_mode=reduce-overhead", *sharded]
                           ).parallelism.cuda_graphs
    assert not load_config("configs/tiny.yaml", ["parallelism.compile=true", *sharded,
                                                 "parallelism.compile_mode=max-autotune-no-cudagraphs"]
                           ).parallelism.cuda_graphs
    # dp_shard=-1 on one worker is no sharding
    assert load_config("configs/tiny.yaml", ["parallelism.compile=true", "parallelism.dp_shard=-1",
                                             "parallelism.nproc_per_node=1",
                                             "parallelism.compile_mode=max-autotune"]).parallelism.cuda_graphs

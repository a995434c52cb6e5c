"""A mixture-of-experts model trains the single-process loss curve under expert parallelism
(fp32, CPU, same global batch), with the harness of test_parallel: EP=2, EP x FSDP, EP x PP
within 1e-5; a checkpoint saved at EP=2 resumes in one process on the same curve; and TP=2
of the blocks around the experts, with and without EP over the TP ranks. 12 steps each (test_parallel's length for four
processes), so that the file stays near a minute and a half of CI on 2 cores; EP x FSDP
(four processes, experts also sharded by FSDP), TP and EP x TP are marked slow (test_moe
checks the gradients of those layouts in CI, EP x FSDP's too but slow).

The model uses every MoE part at once: a dense first block, 4 routed experts (top 2), a
shared expert, the sequence-wise balance loss and the aux-loss-free bias update (whose
token counts must be summed over the whole global batch for the curves to agree)."""

import json

import pytest

from core.protocol import RunDir
from tests.helpers import small_config, synthetic_dataset
from tests.test_parallel import RTOL, assert_same_curve, run_training

STEPS = 12

MOE = ("model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_dim=64",
       "model.moe.shared_experts=1", "model.moe.first_dense_layers=1",
       "model.moe.aux_loss_coeff=0.01", "model.moe.bias_update_rate=0.001")
EP2 = ("parallelism.dp_replicate=1", "parallelism.dp_shard=2", "parallelism.ep=2",
       "training.micro_batch_size=2")
# Two pipeline stages, each with EP over its 2 data-parallel ranks.
EP_PP = ("parallelism.dp_replicate=1", "parallelism.dp_shard=2", "parallelism.ep=2",
         "parallelism.pp=2", "parallelism.microbatches=2", "training.micro_batch_size=2")
# Attention tensor-parallel; each TP rank's MoE computes on its part of every sequence.
TP = ("parallelism.dp_replicate=1", "parallelism.tp=2", "training.micro_batch_size=4")
# Both: the experts split over the 2 TP ranks, each routing its part of the sequences.
EP_TP = ("parallelism.dp_replicate=1", "parallelism.tp=2", "parallelism.ep=2",
         "training.micro_batch_size=4")
# Experts split over 2 EP ranks and sharded by FSDP over the other 2; the rest over all 4.
EP_FSDP = ("parallelism.dp_replicate=1", "parallelism.dp_shard=4", "parallelism.ep=2",
           "training.micro_batch_size=1")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return synthetic_dataset(tmp_path_factory.mktemp("moe-parallel") / "dataset")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, dataset):
    """One process, the whole model, 4 samples x 2 accumulation steps."""
    return run_training(tmp_path_factory.mktemp("moe-reference"), dataset, 1,
                        "training.micro_batch_size=4", *MOE, steps=STEPS)


def test_ep2_matches_one_process_and_its_checkpoint_resumes_in_one_process(tmp_path, dataset,
                                                                          reference):
    expected = reference
    assert_same_curve(run_training(tmp_path, dataset, 2, *EP2, *MOE, steps=STEPS), expected)
    run_dir = small_config(tmp_path, "run.run_id=layout").run_dir
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {"moe/layer1/load_max", "moe/layer1/load_entropy", "moe/layer1/bias_min",
            "moe/aux_loss", "moe/dead_experts"} <= set(records[-1])
    from training.export import ExportError, export_hf

    # Not a Mixtral (a dense first block, a routing bias): the export says so, naming why and
    # what would have trained one that exports.
    with pytest.raises(ExportError, match=r"model.moe.first_dense_layers=1 \(Mixtral: 0\).*routing bias"
                       r".*Trained with model.qk_norm=true .*model.moe.bias_update_rate=0, the same model"):
        export_hf(RunDir.of(run_dir).checkpoint(STEPS), tmp_path / "hf")
    (run_dir / "metrics.jsonl").unlink()
    # The experts (sharded over EP ranks) and the routing bias come back whole in one process.
    resumed = run_training(tmp_path, dataset, 1, "training.micro_batch_size=4", *MOE, steps=STEPS,
                           resume=str(RunDir.of(run_dir).checkpoint(STEPS // 2)))
    assert sorted(resumed) == list(range(STEPS // 2 + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(expected[step], rel=RTOL), (step, loss)


def test_ep_pp_matches_one_process(tmp_path, dataset, reference):
    assert_same_curve(run_training(tmp_path, dataset, 4, *EP_PP, *MOE, steps=STEPS), reference)


@pytest.mark.slow
def test_ep_fsdp_matches_one_process(tmp_path, dataset, reference):
    assert_same_curve(run_training(tmp_path, dataset, 4, *EP_FSDP, *MOE, steps=STEPS), reference)


@pytest.mark.slow
def test_tp_matches_one_process(tmp_path, dataset, reference):
    assert_same_curve(run_training(tmp_path, dataset, 2, *TP, *MOE, steps=STEPS), reference)


@pytest.mark.slow
def test_ep_tp_matches_one_process(tmp_path, dataset, reference):
    assert_same_curve(run_training(tmp_path, dataset, 2, *EP_TP, *MOE, steps=STEPS), reference)

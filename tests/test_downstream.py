"""Downstream benchmarks through lm-evaluation-harness (training.downstream).

The tasks are real lm-eval task YAMLs the test writes, over local jsonl data: a multiple-
choice task, a cloze task (lambada-style loglikelihood) and a rolling one (wikitext-style
bits per byte). The model is a small Transformer trained here on the true sentences of half
the items, saved as a committed checkpoint. Every score lm-eval reports is compared with the
same quantity computed directly with the project's model, one item at a time.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

pytest.importorskip("lm_eval")

from core.config import load_config  # noqa: E402
from core.errors import ConfigError  # noqa: E402
from goodput.evaluation import evaluate  # noqa: E402
from storage.manifests import CheckpointManifest, list_files  # noqa: E402
from tests.helpers import small_config, synthetic_dataset  # noqa: E402
from training.checkpoint.reader import load_model  # noqa: E402
from training.data import open_training_data, sequential_batches  # noqa: E402
from training.downstream import downstream_scores, load_tasks  # noqa: E402
from training.model import ModelArgs, Transformer  # noqa: E402
from training.tokenizer import load_tokenizer, train_tokenizer  # noqa: E402

VOCAB = 320
COLORS = ["red", "green", "blue", "yellow"]
THINGS = ["sky", "grass", "sun", "apple", "sea", "leaf", "lemon", "cherry", "river", "frog",
          "banana", "tomato", "cloud", "moss", "corn", "rose"]
# Each thing's colour; the model is trained on the first half of these sentences only.
FACTS = [(thing, COLORS[(i * 7 + i // 4) % 4]) for i, thing in enumerate(THINGS)]
TRAINED = FACTS[: len(FACTS) // 2]
TASKS = ["colors_mc", "colors_cloze", "colors_text"]


def sentence(thing: str, color: str) -> str:
    return f"the color of the {thing} is {color}"


def write_tasks(folder: Path) -> Path:
    """Three lm-eval task YAMLs over one local jsonl file (absolute path: lm-eval reads
    data_files from the working directory of the evaluation process)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "colors.jsonl"
    data.write_text("".join(json.dumps({
        "context": f"the color of the {thing} is", "answer": color, "choices": COLORS,
        "label": COLORS.index(color), "text": sentence(thing, color)}) + "\n" for thing, color in FACTS))
    common = f"""dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
        test_split: test
        """
    (folder / "colors_mc.yaml").write_text(textwrap.dedent(f"""\
        task: colors_mc
        {common}output_type: multiple_choice
        doc_to_text: "{{{{context}}}}"
        doc_to_choice: choices
        doc_to_target: label
        metric_list:
          - metric: acc
            aggregation: mean
            higher_is_better: true
          - metric: acc_norm
            aggregation: mean
            higher_is_better: true
        """))
    (folder / "colors_cloze.yaml").write_text(textwrap.dedent(f"""\
        task: colors_cloze
        {common}output_type: loglikelihood
        doc_to_text: "{{{{context}}}}"
        doc_to_target: "{{{{' ' + answer}}}}"
        target_delimiter: ""
        metric_list:
          - metric: acc
            aggregation: mean
            higher_is_better: true
          - metric: perplexity
            aggregation: perplexity
            higher_is_better: false
        """))
    (folder / "colors_text.yaml").write_text(textwrap.dedent(f"""\
        task: colors_text
        {common}output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{{{text}}}}"
        metric_list:
          - metric: word_perplexity
            aggregation: weighted_perplexity
            higher_is_better: false
          - metric: byte_perplexity
            aggregation: weighted_perplexity
            higher_is_better: false
          - metric: bits_per_byte
            aggregation: bits_per_byte
            higher_is_better: false
        """))
    return folder


def train_model(tokenizer, seed: int = 0) -> Transformer:
    """A small model that has learned the TRAINED sentences (each one document: EOS, the
    sentence, EOS), about 2 s on 2 cores."""
    torch.manual_seed(seed)
    eos = tokenizer.token_to_id("<|endoftext|>")
    docs = [[eos] + tokenizer.encode(sentence(*fact)).ids + [eos] for fact in TRAINED]
    width = max(map(len, docs))
    batch = torch.full((len(docs), width), eos)
    for i, doc in enumerate(docs):
        batch[i, :len(doc)] = torch.tensor(doc)
    model = Transformer(ModelArgs(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, max_seq_len=64), seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss = model(batch[:, :-1], batch[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.3, loss.item()
    return model.eval()


def save_checkpoint(model: Transformer, path: Path) -> Path:
    """A committed checkpoint of `model`, as training writes one (DCP + manifest)."""
    dcp.save({f"model.{k}": v for k, v in model.state_dict().items()}, checkpoint_id=str(path),
             no_dist=True)
    CheckpointManifest(step=150, tokens_seen=0, files=list_files(path), world_size=1, layout={},
                       config_hash="", dataset_id="", model_args=vars(model.args),
                       created_at=0).save(path)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("downstream")
    texts = [sentence(*fact) for fact in FACTS] * 20
    tokenizer_path = tmp / "tokenizer.json"
    train_tokenizer(texts, vocab_size=VOCAB, min_frequency=1).save(str(tokenizer_path))
    tokenizer = load_tokenizer(tokenizer_path)
    checkpoint = save_checkpoint(train_model(tokenizer), tmp / "step-00000150")
    return {"tmp": tmp, "tokenizer": tokenizer, "tokenizer_path": tokenizer_path,
            "checkpoint": checkpoint, "task_dir": write_tasks(tmp / "tasks")}


def eval_config(task_dir: Path, *more: str):
    return load_config(None, [f"eval.tasks={TASKS}", f"eval.task_dir={task_dir}", *more]).eval


@torch.no_grad()
def logprob(model: Transformer, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """log p(continuation | context) summed, and whether greedy decoding gives it: one item,
    one forward pass, no batching."""
    tokens = torch.tensor([context + continuation])
    logprobs = F.log_softmax(model(tokens[:, :-1]).float(), dim=-1)[0, len(context) - 1:]
    target = torch.tensor(continuation)
    return (logprobs.gather(1, target[:, None]).sum().item(),
            bool((logprobs.argmax(-1) == target).all()))


def test_scores_above_chance_and_equal_a_direct_computation(setup):
    tokenizer = setup["tokenizer"]
    model, _ = load_model(setup["checkpoint"], torch.device("cpu"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    # fp32, as the direct computation: 'auto' takes bf16 on a CPU with bf16 instructions
    scores, results = downstream_scores(model, tokenizer, eos, eval_config(setup["task_dir"], "eval.precision=fp32"),
                                        torch.device("cpu"), log_samples=True)
    assert set(scores) == set(TASKS)

    def encode_pair(context: str, continuation: str) -> tuple[list[int], list[int]]:
        whole, ctx = tokenizer.encode(context + continuation).ids, tokenizer.encode(context).ids
        assert whole[:len(ctx)] == ctx
        return ctx, whole[len(ctx):]

    # Multiple choice: the choice with the highest summed log-probability, per item.
    correct, correct_norm = [], []
    for i, (thing, color) in enumerate(FACTS):
        context = f"the color of the {thing} is"
        lls = [logprob(model, *encode_pair(context, " " + c))[0] for c in COLORS]
        chosen = max(range(4), key=lambda c: lls[c])
        chosen_norm = max(range(4), key=lambda c: lls[c] / len(" " + COLORS[c]))  # per character
        correct.append(chosen == COLORS.index(color))
        correct_norm.append(chosen_norm == COLORS.index(color))
        sample = next(s for s in results["samples"]["colors_mc"] if s["doc_id"] == i)
        assert [r[0] for r in sample["filtered_resps"]] == pytest.approx(lls, abs=1e-4)
    assert scores["colors_mc"]["acc"] == sum(correct) / len(FACTS)
    assert scores["colors_mc"]["acc_norm"] == sum(correct_norm) / len(FACTS)
    assert sum(correct[:len(TRAINED)]) == len(TRAINED)  # every trained fact
    assert scores["colors_mc"]["acc"] > 0.25 + 0.2  # chance is 1/4
    assert scores["colors_mc"]["acc_stderr"] > 0

    # Cloze: whether greedy decoding gives the colour, and its perplexity.
    greedy, lls = [], []
    for thing, color in FACTS:
        ll, is_greedy = logprob(model, *encode_pair(f"the color of the {thing} is", " " + color))
        greedy.append(is_greedy)
        lls.append(ll)
    assert scores["colors_cloze"]["acc"] == sum(greedy) / len(FACTS) >= 0.5
    assert scores["colors_cloze"]["perplexity"] == pytest.approx(math.exp(-sum(lls) / len(FACTS)), rel=1e-4)

    # Rolling: bits per byte of whole sentences, each conditioned on EOS only.
    total_ll = sum(logprob(model, [eos], tokenizer.encode(sentence(*fact)).ids)[0] for fact in FACTS)
    n_bytes = sum(len(sentence(*fact).encode()) for fact in FACTS)
    assert scores["colors_text"]["bits_per_byte"] == pytest.approx(-total_ll / n_bytes / math.log(2), rel=1e-4)

    # eval.limit: the first N items of each task.
    limited, _ = downstream_scores(model, tokenizer, eos, eval_config(setup["task_dir"], "eval.limit=4"),
                                   torch.device("cpu"))
    assert limited["colors_mc"]["acc"] == sum(correct[:4]) / 4


def write_more_tasks(folder: Path) -> Path:
    """Three more shapes: winogrande's partial scoring (two contexts, one continuation scored
    after each), multiple choice over a context longer than the model's max_seq_len (64),
    whose start is cut, and rolling log-likelihoods of a text longer than max_seq_len that the
    model finds unlikely (the story's words backwards, about 100 tokens: two windows, sums
    of several hundred)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "more.jsonl"
    story = " ".join(sentence(*fact) for fact in FACTS[:6])  # about 50 tokens
    data.write_text("".join(json.dumps({
        "sentence": f"the color of the _ is {color}", "option1": thing, "option2": FACTS[(i + 5) % len(FACTS)][0],
        "answer": "1", "long": f"{story} {story} the color of the {thing} is", "choices": COLORS,
        "backwards": " ".join(reversed(f"{story} {thing} {story}".split())),
        "label": COLORS.index(color)}) + "\n" for i, (thing, color) in enumerate(FACTS)))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (folder / "colors_partial.yaml").write_text(
        f"task: colors_partial\n{common}output_type: multiple_choice\n"
        "doc_to_text: \"{{0 if answer == '1' else 1}}\"\n"
        "doc_to_target: \"{{sentence[sentence.index('_') + 1:].strip()}}\"\n"
        "doc_to_choice: \"{{[sentence[:sentence.index('_')] + option1, sentence[:sentence.index('_')] + option2]}}\"\n"
        "metric_list:\n  - {metric: acc, aggregation: mean, higher_is_better: true}\n")
    (folder / "colors_long.yaml").write_text(
        f"task: colors_long\n{common}output_type: multiple_choice\ndoc_to_text: \"{{{{long}}}}\"\n"
        "doc_to_choice: choices\ndoc_to_target: label\n"
        "metric_list:\n  - {metric: acc, aggregation: mean, higher_is_better: true}\n")
    (folder / "colors_backwards.yaml").write_text(
        f"task: colors_backwards\n{common}output_type: loglikelihood_rolling\ndoc_to_text: \"\"\n"
        "doc_to_target: \"{{backwards}}\"\n"
        "metric_list:\n  - {metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}\n")
    return folder


def test_packed_scoring_equals_scoring_each_request_whole(setup, tmp_path):
    """ProjectLM packs an item's requests into one sequence (its context read once); the
    scores equal those of the path before (every request whole, in its own row, kept in
    benchmarks/eval_bench.py): accuracies exactly, each log-likelihood within 1e-4."""
    import sys

    from lm_eval import evaluator

    from tests.helpers import REPO
    from training.downstream import native_bf16, pack_requests, project_lm, task_manager_for, uses_bf16

    sys.path.insert(0, str(REPO / "benchmarks"))
    from eval_bench import whole_requests_lm

    task_dir = write_tasks(tmp_path / "tasks")
    write_more_tasks(task_dir)
    names = [*TASKS, "colors_partial", "colors_long", "colors_backwards"]
    tokenizer, eos = setup["tokenizer"], setup["tokenizer"].token_to_id("<|endoftext|>")
    model, _ = load_model(setup["checkpoint"], torch.device("cpu"))
    results = {}
    for name, make in (("packed", project_lm), ("whole", whole_requests_lm)):
        # batch size 3: batches mix items of different shapes and lengths
        lm = make(model, tokenizer, eos, 3, torch.device("cpu"))
        results[name] = evaluator.simple_evaluate(
            model=lm, tasks=names, task_manager=task_manager_for(names, str(task_dir)),
            bootstrap_iters=0, log_samples=True, random_seed=0, numpy_random_seed=0,
            torch_random_seed=0, fewshot_random_seed=0)
    packed, whole = results["packed"], results["whole"]

    def lls(sample) -> list[float]:
        return [r[0] if isinstance(r, (list, tuple)) else r for r in sample["filtered_resps"]]

    for task in names:
        assert len(packed["samples"][task]) == len(FACTS)
        for a, b in zip(packed["samples"][task], whole["samples"][task]):
            assert a["doc_id"] == b["doc_id"]
            assert lls(a) == pytest.approx(lls(b), abs=1e-4, rel=0)
        for metric, value in whole["results"][task].items():
            if metric.startswith(("acc,", "acc_norm,")):
                assert packed["results"][task][metric] == value, (task, metric)
            elif isinstance(value, float):
                assert packed["results"][task][metric] == pytest.approx(value, rel=1e-5), (task, metric)
    assert packed["results"]["colors_mc"]["acc,none"] > 0.25 + 0.2  # a trained model, not chance

    # eval.precision=bf16 (what 'auto' runs on a GPU, and on a CPU with bf16 instructions):
    # the same packed path under bf16 autocast, log-likelihoods near fp32's and the accuracy
    # within lm-eval's own stderr of fp32's.
    bf16 = evaluator.simple_evaluate(
        model=project_lm(model, tokenizer, eos, 3, torch.device("cpu"), precision="bf16"), tasks=["colors_mc"],
        task_manager=task_manager_for(["colors_mc"], str(task_dir)), bootstrap_iters=100, log_samples=True)
    for a, b in zip(bf16["samples"]["colors_mc"], packed["samples"]["colors_mc"]):
        assert [r[0] for r in a["filtered_resps"]] == pytest.approx([r[0] for r in b["filtered_resps"]], rel=0.05, abs=0.1)
    acc = bf16["results"]["colors_mc"]
    assert acc["acc,none"] == pytest.approx(packed["results"]["colors_mc"]["acc,none"], abs=acc["acc_stderr,none"])
    assert acc["acc,none"] > 0.25 + 0.2
    assert uses_bf16("auto", torch.device("cpu")) == native_bf16(torch.device("cpu"))
    assert not uses_bf16("fp32", torch.device("cpu")) and uses_bf16("bf16", torch.device("cpu"))

    # What packing reads: each multiple-choice context once, the partial-scoring items' two
    # contexts up to where they differ once, and the long contexts cut to max_seq_len.
    lm = project_lm(model, tokenizer, eos, 3, torch.device("cpu"))
    encode = lm._encode_pair
    context = "the color of the sky is"
    pairs = [encode(context, " " + color) for color in COLORS]
    (row,) = pack_requests(pairs, [0] * 4, 64)
    ids = tokenizer.encode(context).ids
    assert row.tokens[:len(ids)] == ids and row.segments[:len(ids)] == [0] * len(ids)
    assert len(row.tokens) == len(ids) + sum(len(c) - 1 for _, c in pairs)
    for j, (i, where, continuation) in enumerate(row.scored):
        assert i == j and where[0] == len(ids) - 1 and continuation == pairs[j][1]
        assert [row.positions[k] for k in where] == list(range(len(ids) - 1, len(ids) - 1 + len(continuation)))
    long_pairs = [encode(f"{' '.join(sentence(*f) for f in FACTS * 2)} the color of the sky is", " " + c)
                  for c in COLORS]
    (row,) = pack_requests(long_pairs, [0] * 4, 64)
    assert max(row.positions) == 63 and len(row.tokens) < sum(min(64, len(c) + len(t) - 1) for c, t in long_pairs)


def test_a_tokenizer_that_starts_texts_with_a_bos_is_scored_as_its_documents_were_trained(setup):
    """A tokenizer whose template puts a BOS first (Llama's): prepare starts every document
    with it (training.tokenizer.document_prefix), and so does scoring, once. It used to add
    the BOS to a rolling text after lm-eval's prefix token (the EOS), and to the continuation
    of an empty context."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer, processors

    from training.downstream import project_lm
    from training.tokenizer import document_prefix

    plain = setup["tokenizer"]
    eos = plain.token_to_id("<|endoftext|>")
    tokenizer = Tokenizer.from_str(plain.to_str())
    used = set(plain.encode(" ".join(sentence(*fact) for fact in FACTS)).ids)
    bos = max(set(range(1, VOCAB)) - used)  # an id no sentence encodes to stands for the BOS
    token = tokenizer.id_to_token(bos)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{token} $A", special_tokens=[(token, bos)])
    assert document_prefix(tokenizer) == [bos] and document_prefix(plain) == []
    model, _ = load_model(setup["checkpoint"], torch.device("cpu"))
    lm = project_lm(model, tokenizer, eos, 2, torch.device("cpu"), doc_prefix_ids=[bos])
    text = sentence(*FACTS[0])
    ids = plain.encode(text).ids
    assert lm.tok_encode(text) == [bos] + ids and lm.tok_encode(text, add_special_tokens=False) == ids
    (rolling,) = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))])
    assert rolling == pytest.approx(logprob(model, [bos], ids)[0], abs=1e-4)  # "<s> text", once
    (empty,) = lm.loglikelihood([SimpleNamespace(args=("", " " + text), task_name="t", doc_id=0)])
    assert empty[0] == pytest.approx(logprob(model, [bos], plain.encode(" " + text).ids)[0], abs=1e-4)
    context = "the color of the sky is"
    assert lm._encode_pair(context, " red") == ([bos] + plain.encode(context).ids, plain.encode(" red").ids)


def test_generation_cuts_a_long_context_once_as_lm_evals_hf_model_does(setup):
    """generate_until is greedy and stops at `until`; a context longer than the model's
    window keeps its last max_length - max_gen_toks tokens, cut once (lm-eval's hf model), so
    the generated tokens never push the context's end out of the window. A window slid per
    token gave other text than the hf model on every long prompt."""
    from types import SimpleNamespace

    from training.downstream import project_lm

    tokenizer, eos = setup["tokenizer"], setup["tokenizer"].token_to_id("<|endoftext|>")
    model, _ = load_model(setup["checkpoint"], torch.device("cpu"))
    lm = project_lm(model, tokenizer, eos, 2, torch.device("cpu"))
    thing, color = TRAINED[0]
    short = f"the color of the {thing} is"
    long = " ".join(sentence(*fact) for fact in FACTS) + " " + short
    ids = tokenizer.encode(long).ids
    assert len(ids) > model.args.max_seq_len
    max_new = 6
    texts = lm.generate_until([SimpleNamespace(args=(short, {"until": ["\n"], "max_gen_toks": 3})),
                               SimpleNamespace(args=(long, {"until": [], "max_gen_toks": max_new}))])
    assert texts[0].strip() == color  # what it was trained on
    tokens = torch.tensor([ids[-(model.args.max_seq_len - max_new):]])
    with torch.no_grad():
        for _ in range(max_new):  # the window never slides: the context's end stays in it
            tokens = torch.cat([tokens, model(tokens)[:, -1, :VOCAB].argmax(-1, keepdim=True)], dim=1)
    generated = tokens[0, model.args.max_seq_len - max_new:].tolist()
    if eos in generated:
        generated = generated[:generated.index(eos)]
    assert texts[1] == tokenizer.decode(generated)
    # max_gen_toks' aliases are read as lm-eval's backends read them (max_new_tokens: 3 was
    # ignored, and 256 tokens generated from a context cut to one token).
    assert lm.generate_until([SimpleNamespace(args=(short, {"until": ["\n"], "max_new_tokens": 3}))]) == texts[:1]
    # A generation budget that leaves no room for the prompt is refused, as by the hf model.
    with pytest.raises(ConfigError, match="up to 256 new tokens .* context of 64 tokens"):
        lm.generate_until([SimpleNamespace(args=(short, {"until": ["\n"]}))])  # 256 by default


def test_the_evaluation_process_reports_scores_and_bits_per_byte(setup):
    """python -m training.evaluate (goodput.evaluation.evaluate), as the evaluate flow runs it."""
    tmp = setup["tmp"]
    dataset = synthetic_dataset(tmp / "data", vocab_size=VOCAB)
    (dataset / "tokenizer.json").write_bytes(setup["tokenizer_path"].read_bytes())
    config = small_config(tmp, f"eval.tasks={TASKS}", f"eval.task_dir={setup['task_dir']}",
                          "eval.limit=8", "eval.max_batches=2")
    report = evaluate(config, setup["checkpoint"], dataset)

    model, _ = load_model(setup["checkpoint"], torch.device("cpu"))
    direct, _ = downstream_scores(model, setup["tokenizer"], 0, config.eval, torch.device("cpu"))
    assert report.downstream.keys() == direct.keys()
    for task, metrics in direct.items():
        assert report.downstream[task] == pytest.approx(metrics, rel=1e-6)
    # bits/byte = loss (nats/token) x tokens / (ln 2 x the bytes those tokens decode to).
    stream = open_training_data(dataset).sources[0].stream("validation")
    targets = torch.cat([t.reshape(-1) for _, t in sequential_batches(stream, 64, 8, 2)]).tolist()
    n_bytes = len(setup["tokenizer"].decode(targets).encode())
    assert report.tokens_evaluated == len(targets)
    assert report.bits_per_byte == pytest.approx(report.loss * len(targets) / (math.log(2) * n_bytes))
    # How it was made, for a reader comparing it with another report: 'auto' resolved.
    from training.downstream import native_bf16

    assert report.settings == {
        "device": "cpu", "max_batches": 2, "batch_size": config.eval.batch_size, "seq_len": 64,
        "tasks": TASKS, "limit": 8, "num_fewshot": None,
        "precision": "bf16" if native_bf16(torch.device("cpu")) else "fp32",
        "lm_eval": importlib.metadata.version("lm_eval")}


@pytest.mark.slow  # two lm-eval indexes; CI: test_the_evaluation_process_exits_with_a_config_error
def test_an_unknown_task_is_a_config_error_naming_it(setup):
    with pytest.raises(ConfigError) as err:
        load_tasks(["colors_mcq"], str(setup["task_dir"]))
    message = str(err.value)
    assert "eval.tasks" in message and "'colors_mcq'" in message and "did you mean colors_mc" in message
    with pytest.raises(ConfigError, match="eval.tasks: 'hellaswagg' .*did you mean hellaswag"):
        load_tasks(["hellaswagg"], None)


def test_a_broken_task_folder_is_a_config_error_naming_the_file(setup, tmp_path):
    folder = write_tasks(tmp_path / "tasks")
    (folder / "broken.yaml").write_text("task: broken\ndoc_to_text: [unclosed\n")
    with pytest.raises(ConfigError) as err:
        load_tasks(["colors_mc"], str(folder))
    assert "eval.task_dir" in str(err.value) and str(folder / "broken.yaml") in str(err.value)
    assert "fix or remove the file" in str(err.value)

    # A task whose data is not there: named, with how to provide it.
    (folder / "broken.yaml").unlink()
    (folder / "colors.jsonl").unlink()
    with pytest.raises(ConfigError, match="task 'colors_mc' could not be loaded .*--fetch"):
        load_tasks(["colors_mc"], str(folder))

    with pytest.raises(ConfigError, match="eval.task_dir=.* is not a directory"):
        load_tasks(["colors_mc"], str(tmp_path / "nowhere"))


def test_the_evaluation_process_exits_with_a_config_error(setup, tmp_path):
    """A typo in eval.tasks fails the evaluation as a configuration error (exit 2, not retried),
    before the checkpoint is read."""
    dataset = synthetic_dataset(tmp_path / "data", vocab_size=VOCAB)
    (dataset / "tokenizer.json").write_bytes(setup["tokenizer_path"].read_bytes())
    config = small_config(tmp_path, "eval.tasks=[colors_mcq]", f"eval.task_dir={setup['task_dir']}")
    with pytest.raises(ConfigError, match="eval.tasks: 'colors_mcq'.*did you mean colors_mc"):
        evaluate(config, setup["checkpoint"], dataset)


def test_config_refuses_blank_and_repeated_task_names():
    with pytest.raises(ConfigError, match="eval.tasks: hellaswag listed more than once"):
        load_config(None, ["eval.tasks=[hellaswag, piqa, hellaswag]"])
    with pytest.raises(ConfigError, match="eval.tasks: an empty task name"):
        load_config(None, ["eval.tasks=['']"])


# --- eval.tasks resolved before anything launches (training.downstream.check_task_names, the
# check-eval-tasks task the train, pipeline and evaluate flows run first) ---

@pytest.fixture
def names_cache(tmp_path, monkeypatch):
    """lm-eval's task names kept in a fresh folder, none kept in this process."""
    import training.downstream as downstream

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(downstream, "_LIBRARY_NAMES", {})
    return tmp_path / "cache" / "goodput"


@pytest.fixture(scope="module")
def library_index(tmp_path_factory):
    """lm-eval's task names indexed once for the module (seconds each time): what
    training.downstream keeps per process, {signature: names}."""
    import training.downstream as downstream

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("names")))
        patch.setattr(downstream, "_LIBRARY_NAMES", {})
        downstream.library_task_names()
        return dict(downstream._LIBRARY_NAMES)


@pytest.fixture
def names_known(names_cache, library_index, monkeypatch):
    """As names_cache, but lm-eval's names indexed in this process already (the module's)."""
    import training.downstream as downstream

    monkeypatch.setattr(downstream, "_LIBRARY_NAMES", dict(library_index))
    return names_cache


def test_task_names_are_checked_without_loading_tasks(setup, names_cache):
    from training.downstream import check_task_names

    task_dir = str(setup["task_dir"])
    # Custom tasks only: lm-eval's own library is not indexed at all.
    assert check_task_names(TASKS, task_dir) == dict.fromkeys(TASKS, "eval.task_dir")
    assert not names_cache.exists()
    assert check_task_names(["colors_mc", "hellaswag", "ai2_arc"], task_dir) == {
        "colors_mc": "eval.task_dir", "hellaswag": "lm-eval", "ai2_arc": "lm-eval"}

    with pytest.raises(ConfigError) as err:  # a typo in a custom task's name
        check_task_names(["colors_mc", "colors_clozee"], task_dir)
    message = str(err.value)
    assert message.startswith("eval.tasks: 'colors_clozee' (did you mean colors_cloze")
    assert "is not a task, group or tag of lm-eval" in message and f"or of eval.task_dir={task_dir}" in message
    assert f"`lm-eval ls tasks --include_path {task_dir}`" in message

    with pytest.raises(ConfigError) as err:  # and in a built-in one, two at once
        check_task_names(["hellaswg", "colors_mc", "arc_esy"], None)
    message = str(err.value)
    assert "eval.tasks: 'hellaswg' (did you mean hellaswag" in message
    assert "'arc_esy' (did you mean arc_easy" in message and "are not a task" in message
    assert "`lm-eval ls tasks`" in message  # colors_mc is unknown without the task folder
    assert "'colors_mc'" in message


def test_a_task_of_the_task_dir_whose_data_file_is_missing_is_named_before_training(tmp_path):
    """A custom task's data_files not there failed every evaluation of the run, each after
    training; the check the flows make first names the task, its YAML and the file."""
    from training.downstream import check_task_names

    task_dir = write_tasks(tmp_path / "tasks")
    (task_dir / "colors.jsonl").rename(tmp_path / "moved.jsonl")
    with pytest.raises(ConfigError) as err:
        check_task_names(["colors_mc"], str(task_dir))
    message = str(err.value)
    assert message.startswith(f"eval.tasks: task 'colors_mc' ({task_dir / 'colors_mc.yaml'}) reads "
                              f"{task_dir / 'colors.jsonl'} (its dataset_kwargs.data_files), which is "
                              "not here. Fix the path in the task's YAML"), message
    (tmp_path / "moved.jsonl").rename(task_dir / "colors.jsonl")
    assert check_task_names(["colors_mc"], str(task_dir)) == {"colors_mc": "eval.task_dir"}


def test_a_best_metric_of_no_known_task_is_refused_before_training(setup, names_known):
    """eval.best_metric's task outside eval.tasks must at least be a task lm-eval knows (a
    subtask of a group there): otherwise no report would have it, and best-by-eval retention
    would keep nothing for it."""
    from goodput.evaluation import check_tasks

    task_dir = str(setup["task_dir"])
    ok = load_config(None, ["eval.tasks=[colors_mc]", f"eval.task_dir={task_dir}",
                            "eval.best_metric=colors_cloze/acc"])
    assert check_tasks(ok) == {"colors_mc": "eval.task_dir"}
    wrong = load_config(None, ["eval.tasks=[colors_mc]", f"eval.task_dir={task_dir}",
                               "eval.best_metric=no_such_task_at_all/acc"])
    with pytest.raises(ConfigError, match=r"eval.best_metric='no_such_task_at_all/acc': "
                       r"'no_such_task_at_all' is neither a task of eval.tasks \(colors_mc\)"):
        check_tasks(wrong)


def test_lm_eval_task_names_are_kept_per_lm_eval_version_and_task_files(names_cache):
    import training.downstream as downstream
    from training.downstream import check_task_names, library_task_names

    names = library_task_names()  # indexed (seconds) and kept on disk
    assert {"hellaswag", "arc_easy", "piqa", "lambada_openai", "winogrande"} <= names
    (kept,) = names_cache.glob("lm-eval-*-task-names.json")
    record = json.loads(kept.read_text())
    assert set(record["names"]) == names

    def keep(names: list[str], signature: list | None = None) -> None:
        kept.write_text(json.dumps({"signature": signature or record["signature"], "names": names}))
        downstream._LIBRARY_NAMES.clear()

    keep(["hellaswag", "made_up_task"])  # the kept names are what a new process reads
    assert library_task_names() == {"hellaswag", "made_up_task"}
    # A name missing from kept names is looked up in a fresh index before it is refused.
    keep(["made_up_task"])
    assert check_task_names(["hellaswag"], None) == {"hellaswag": "lm-eval"}
    assert set(json.loads(kept.read_text())["names"]) == names
    # Names kept for other task files (lm-eval upgraded, a task edited) are not used.
    keep(["made_up_task"], signature=[*record["signature"][:2], record["signature"][2] + 1,
                                      *record["signature"][3:]])
    assert library_task_names() == names


def test_flows_refuse_an_unknown_task_before_anything_launches(prefect_api, setup, tmp_path,
                                                                names_known):
    from flows.evaluate import evaluate as evaluate_flow
    from flows.pipeline import pipeline
    from flows.train import train
    from tests.helpers import task_runs_of

    task_dir = setup["task_dir"]
    # train: a typo in a custom task's name; no dataset either, but the config error comes first.
    config = small_config(tmp_path, "run.run_id=typo", "eval.tasks=[colors_mc, colors_mcq]",
                          f"eval.task_dir={task_dir}", "eval.every_validated=1")
    state = train(config, return_state=True)
    assert state.is_failed()
    with pytest.raises(ConfigError, match=r"^eval.tasks: 'colors_mcq' \(did you mean colors_mc, .*\) is "
                                          r"not a task, group or tag of lm-eval .* or of eval.task_dir="):
        state.result()
    runs = task_runs_of(state.state_details.flow_run_id, "check-eval-tasks")
    assert "launch-training" not in runs and runs["check-eval-tasks"].state.is_failed()
    assert runs["check-eval-tasks"].run_count == 1  # a configuration error is not retried
    assert not config.run_dir.checkpoints.exists()

    # pipeline: a typo in a built-in name fails before the dataset is prepared.
    config = small_config(tmp_path / "pipeline", "run.run_id=typo-pipeline", "eval.tasks=[colors_mc, hellaswg]",
                          f"eval.task_dir={task_dir}")
    state = pipeline(config, return_state=True)
    assert state.is_failed()
    with pytest.raises(ConfigError) as err:
        state.result()
    assert "eval.tasks: 'hellaswg' (did you mean hellaswag" in str(err.value)
    assert f"`lm-eval ls tasks --include_path {task_dir}`" in str(err.value)
    expected = {"resolve-config", "check-eval-tasks", "check-layout"}
    assert set(task_runs_of(state.state_details.flow_run_id, *expected)) == expected
    assert not (tmp_path / "pipeline" / "data").exists()

    # evaluate (`goodput evaluate`): before a checkpoint is located, downloaded or read.
    config = small_config(tmp_path / "evaluate", "run.run_id=typo", "eval.tasks=[colors_texts]",
                          f"eval.task_dir={task_dir}")
    state = evaluate_flow(config, checkpoint=str(setup["checkpoint"]), return_state=True)
    assert state.is_failed()
    with pytest.raises(ConfigError, match="eval.tasks: 'colors_texts' \\(did you mean colors_text"):
        state.result()
    assert "locate-checkpoint" not in task_runs_of(state.state_details.flow_run_id, "check-eval-tasks")

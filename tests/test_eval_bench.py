"""benchmarks/eval_bench.py: its five local tasks load in lm-eval with the real tasks' request
shapes, and (slow) the whole bench runs end to end on CPU at a tiny size."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval")

from tests.helpers import REPO  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
import eval_bench  # noqa: E402


def test_the_local_tasks_have_the_real_tasks_request_shapes(tmp_path):
    from goodput.data.corpus import build_builtin_corpus
    from training.tokenizer import train_tokenizer

    corpus = build_builtin_corpus(tmp_path / "corpus")
    task_dir = eval_bench.write_tasks(tmp_path / "tasks", corpus, count=12)
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()[:300]]
    tokenizer = train_tokenizer(texts, vocab_size=512, min_frequency=2)
    counts = eval_bench.request_counts(task_dir, list(eval_bench.TASKS), 10, tokenizer)
    choices = {"hellaswag": 4, "arc_easy": 4, "piqa": 2, "lambada": 1, "winogrande": 2}
    for task, per_item in choices.items():
        assert counts[task]["items"] == 10 and counts[task]["requests"] == 10 * per_item, (task, counts)
        assert counts[task]["tokens"] > 0

    from training.downstream import load_tasks

    _, (hellaswag, winogrande) = load_tasks(["local_hellaswag", "local_winogrande"], str(task_dir))
    for task in (hellaswag, winogrande):
        task.build_all_requests(limit=3, rank=0, world_size=1)
    # hellaswag: one context, four long endings; winogrande: partial scoring, i.e. two
    # contexts (up to the blank, with each option) and one continuation scored after them.
    first = [i.args for i in hellaswag.instances if i.doc_id == 0]
    assert len({context for context, _ in first}) == 1
    assert all(len(ending.split()) == 25 for _, ending in first)
    first = [i.args for i in winogrande.instances if i.doc_id == 0]
    assert len({context for context, _ in first}) == 2 and len({rest for _, rest in first}) == 1


@pytest.mark.slow
def test_the_bench_runs_end_to_end_at_a_tiny_size(tmp_path):
    """About 2 minutes on 2 cores: seven evaluation processes and two train flows."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "eval_bench.py"), "--model", "tiny", "--limit", "6",
         "--tasks", "hellaswag,lambada,winogrande", "--train-model", "tiny", "--train-steps", "24",
         "--checkpoint-every", "6", "--every-validated", "1", "--train-limit", "3",
         "--workdir", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["eval"]["tasks"]
    assert list(rows) == ["hellaswag", "lambada", "winogrande"]
    assert [rows[t]["requests"] for t in rows] == [24, 6, 12]
    assert set(result["eval"]["together"]["scores"]) == {"local_hellaswag", "local_lambada", "local_winogrande"}
    runs = result["train"]["runs"]
    assert [r["every_validated"] for r in runs] == [0, 1]
    assert runs[0]["evaluations"] == 0 and runs[1]["evaluations"] == 4  # checkpoints 6, 12, 18, 24
    assert all(len(r["steps"]) == 21 for r in runs)  # steps 4-24
    assert "| **all 3 in one evaluation** |" in proc.stdout
    assert "| evaluations on: steps while one ran |" in proc.stdout

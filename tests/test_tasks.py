"""`compress eval --tasks`: lm-eval tasks scored on compress checkpoints, and gated.

No hub here, so the task is a local one written as lm-eval YAML: a word cloze on Tiny
Shakespeare's test text (300 characters of context, the next word among four of about the same
frequency in that text, so that the model must read the context to choose)."""

import collections
import json
import random
import re

import pytest

from compress.cli import main
from tests.test_cli import run

TASK = "ts_cloze"


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, shared):
    text = (shared / "data/tinyshakespeare/test.txt").read_text()
    words = list(re.finditer(r"[A-Za-z]+", text))
    ranked = [w for w, _ in collections.Counter(m.group(0) for m in words).most_common()]
    rank = {w: i for i, w in enumerate(ranked)}
    rng = random.Random(0)
    docs = []
    for k in sorted(rng.sample(range(50, len(words)), 600)):
        word, context = words[k].group(0), text[max(0, words[k].start() - 300): words[k].start()]
        if not context.endswith(" "):
            continue
        r = rank[word]
        choices = [word] + rng.sample([w for w in ranked[max(0, r - 20): r + 21] if w != word], 3)
        rng.shuffle(choices)
        docs.append({"context": context[:-1], "choices": [" " + c for c in choices], "label": choices.index(word)})
    d = tmp_path_factory.mktemp("tasks")
    (d / "cloze.jsonl").write_text("\n".join(map(json.dumps, docs)))
    cloze = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {d / 'cloze.jsonl'}\n"
             "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
             "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n")
    (d / "cloze.yaml").write_text(f"task: {TASK}\n" + cloze)
    # the same task twice more under a tag, and in a group without an aggregate score
    (d / "tagged.yaml").write_text("task: ts_cloze_b\ntag: ts_tag\n" + cloze)
    (d / "tagged2.yaml").write_text("task: ts_cloze_c\ntag: ts_tag\n" + cloze)
    (d / "group.yaml").write_text("group: ts_group\ntask: [ts_cloze_b, ts_cloze_c]\n")
    # perplexity (lower is better), like lm-eval's wikitext: Tiny Shakespeare's speeches
    (d / "ppl.jsonl").write_text("\n".join(json.dumps({"page": p}) for p in text.split("\n\n")[:40] if len(p) > 200))
    (d / "ppl.yaml").write_text(
        f"task: ts_ppl\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {d / 'ppl.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{page}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    return d


@pytest.fixture(scope="module")
def p95(tmp_path_factory, ref_llama):
    """ref-llama with 95 % of each layer's weights gone: perplexity and the tasks both suffer."""
    out = tmp_path_factory.mktemp("p95") / "out"
    assert main(["--quiet", "prune", "--model", str(ref_llama), "--method", "magnitude", "--sparsity", "0.95",
                 "--output", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def w4_packed(tmp_path_factory, ref_llama):
    d = tmp_path_factory.mktemp("w4")
    (d / "r.yaml").write_text("stages:\n  - rtn:\n      scheme: W4A16\n      weights: {group_size: 64}\n")
    assert main(["--quiet", "quantize", "--recipe", str(d / "r.yaml"), "--model", str(ref_llama), "--output", str(d / "out")]) == 0
    return d / "out"


def test_scores_equal_lm_eval_on_the_checkpoint_loaded_by_transformers(task_dir, w4_packed, capsys):
    """The number compress reports is lm-eval's own on the same weights: the packed W4
    checkpoint loaded by plain transformers (compressed-tensors decompresses it) scores the same."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert json.loads((w4_packed / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"
    rc, out, _ = run(capsys, "--json", "eval", "--model", w4_packed, "--tasks", TASK, "--include-path", task_dir, "--limit", 150)
    assert rc == 0
    ours = json.loads(out)["tasks"][TASK]
    assert ours["metric"] == "acc" and ours["samples"] == 150 and ours["stderr"] > 0

    lm = HFLM(pretrained=AutoModelForCausalLM.from_pretrained(w4_packed), tokenizer=AutoTokenizer.from_pretrained(w4_packed),
              batch_size=8)
    theirs = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=TaskManager(include_path=str(task_dir)), limit=150,
                                     log_samples=False)["results"][TASK]
    assert ours["score"] == theirs["acc,none"] and ours["stderr"] == theirs["acc_stderr,none"]


def test_gate_passes_the_same_model_and_fails_a_damaged_one(task_dir, ref_llama, p95, tmp_path, capsys):
    rc, out, _ = run(capsys, "--json", "eval", "--model", ref_llama, "--baseline", ref_llama, "--tasks", TASK,
                     "--include-path", task_dir, "--limit", 300, "--max-task-drop", 0, "--min-task-score", 0.3)
    same = json.loads(out)
    assert rc == 0 and same["passed"] and same["tasks"][TASK]["score_drop"] == 0
    assert [c["metric"] for c in same["checks"]] == ["acc", "acc worse than baseline by"]

    # the pruned model's accuracy falls by 0.083 (measured)
    report, junit = tmp_path / "eval.md", tmp_path / "junit.xml"
    rc, out, _ = run(capsys, "--json", "eval", "--model", p95, "--baseline", ref_llama, "--tasks", TASK,
                     "--include-path", task_dir, "--limit", 300, "--max-task-drop", 0.03, "--report", report, "--junit", junit)
    damaged = json.loads(out)
    r = damaged["tasks"][TASK]
    assert rc == 1 and not damaged["passed"]
    assert r["baseline_score"] == same["tasks"][TASK]["score"] and r["score_drop"] > 0.05
    assert (f"| {TASK} | acc | {r['score']:.4f} ± {r['stderr']:.4f} | 300 | {r['baseline_score']:.4f} | {r['score_drop']:.4f} |"
            in report.read_text())
    assert 'failures="1"' in junit.read_text() and "acc worse than baseline by" in junit.read_text()


def test_tasks_refused_before_any_model_is_loaded(task_dir, minilm, capsys, monkeypatch):
    from compress import modeling

    loads = []
    monkeypatch.setattr(modeling, "load_model", lambda *a, **k: loads.append(a) or pytest.fail("model loaded"))
    rc, _, err = run(capsys, "eval", "--model", "default", "--tasks", "no_such_task", "--include-path", task_dir)
    assert rc == 2 and "unknown lm-eval task: no_such_task" in err and "--include-path" in err
    rc, _, err = run(capsys, "eval", "--model", minilm, "--tasks", TASK, "--include-path", task_dir)
    assert rc == 2 and "is an encoder" in err
    assert not loads


def test_a_local_tasks_missing_data_is_refused_before_any_model_is_loaded(task_dir, tmp_path, capsys, monkeypatch):
    """lm-eval reads a task's data files when the task runs: in a recipe, after every stage. A file
    named in the task's YAML that does not exist is refused up front, also through a tag or group."""
    from compress import modeling

    lost = tmp_path / "tasks"
    lost.mkdir()
    cloze = (task_dir / "cloze.yaml").read_text()
    (lost / "lost.yaml").write_text(cloze.replace("task: ts_cloze", "task: lost\ntag: lost_tag").replace(
        str(task_dir / "cloze.jsonl"), str(tmp_path / "gone.jsonl")))
    (lost / "group.yaml").write_text("group: lost_group\ntask: [lost]\n")
    monkeypatch.setattr(modeling, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    for name in ("lost", "lost_tag", "lost_group"):
        rc, _, err = run(capsys, "eval", "--model", "default", "--tasks", name, "--include-path", lost)
        assert rc == 2 and f"lm-eval task lost ({lost / 'lost.yaml'}): its data {tmp_path / 'gone.jsonl'} does not exist" in err, name
    # data_files inside a local dataset_path directory are read from there; a hub dataset's from
    # its repository (lm-eval's c4 names en/c4-validation...json.gz there), which is not looked up
    from compress.tasks import check_local_data, task_manager

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "test.jsonl").write_text((task_dir / "cloze.jsonl").read_text())
    (lost / "in_dir.yaml").write_text(cloze.replace("task: ts_cloze", "task: in_dir").replace("dataset_path: json", f"dataset_path: {tmp_path / 'corpus'}")
                                      .replace(str(task_dir / "cloze.jsonl"), "test.jsonl"))
    manager = task_manager(lost)
    check_local_data(["in_dir", "c4"], manager)
    (tmp_path / "corpus" / "test.jsonl").unlink()
    with pytest.raises(Exception, match=f"its data {tmp_path / 'corpus' / 'test.jsonl'} does not exist"):
        check_local_data(["in_dir"], task_manager(lost))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"stages:\n  - magnitude: {{sparsity: 0.5}}\nevaluation:\n  tasks: {{names: [lost], include_path: {lost}}}\n")
    rc, _, err = run(capsys, "quantize", "--recipe", recipe, "--model", "default", "--output", tmp_path / "out")
    assert rc == 2 and "its data" in err and not (tmp_path / "out").exists()


def test_without_lm_eval_the_message_says_what_to_install(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    rc, _, err = run(capsys, "eval", "--model", "default", "--tasks", "arc_easy")
    assert rc == 2 and "--tasks needs lm-eval" in err and "pip install 'compress[tasks]'" in err


def test_task_metric_must_be_one_the_task_reports(task_dir, capsys):
    rc, out, err = run(capsys, "--json", "eval", "--model", "default", "--tasks", TASK, "--include-path", task_dir,
                       "--limit", 4, "--task-metric", "f1")
    assert rc == 2 and json.loads(out)["error"] == "--task-metric f1: the task reports acc"


def test_perplexity_tasks_are_gated_the_right_way_up(task_dir, ref_llama, p95, capsys):
    """word_perplexity is better when lower: the pruned model's rise must fail the gate."""
    rc, out, _ = run(capsys, "--json", "eval", "--model", p95, "--baseline", ref_llama, "--tasks", "ts_ppl",
                     "--include-path", task_dir, "--limit", 8, "--max-task-drop", 100)
    r = json.loads(out)["tasks"]["ts_ppl"]
    assert rc == 1 and r["metric"] == "word_perplexity" and not r["higher_is_better"]
    assert r["score"] > r["baseline_score"] + 100 and r["score_drop"] == pytest.approx(r["score"] - r["baseline_score"], rel=1e-12)
    rc, _, err = run(capsys, "eval", "--model", p95, "--tasks", "ts_ppl", "--include-path", task_dir, "--limit", 2,
                     "--min-task-score", 0.5)
    assert rc == 2 and "ts_ppl's word_perplexity is better when lower" in err


def test_tags_and_groups_without_an_aggregate_are_scored_task_by_task(task_dir, capsys):
    for name in ("ts_tag", "ts_group"):
        rc, out, _ = run(capsys, "--json", "eval", "--model", "default", "--tasks", name, "--include-path", task_dir,
                         "--limit", 6, "--min-task-score", 0)
        result = json.loads(out)
        assert rc == 0 and sorted(result["tasks"]) == ["ts_cloze_b", "ts_cloze_c"], name
        assert [c["dataset"] for c in result["checks"]] == ["task ts_cloze_b", "task ts_cloze_c"]


def test_thresholds_that_cannot_fail_or_need_a_baseline_are_refused(task_dir, ref_llama, capsys, monkeypatch):
    rc, _, err = run(capsys, "eval", "--model", "default", "--baseline", "default", "--tasks", TASK, "--include-path", task_dir,
                     "--limit", 2, "--max-task-drop", 1)
    assert rc == 2 and "--max-task-drop 1 can never fail: ts_cloze's acc lies in [0, 1]" in err
    from compress import evaluate_model, modeling
    from compress.errors import CompressError
    from compress.tasks import TaskRequest

    monkeypatch.setattr(modeling, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(CompressError, match="--max-task-drop compares against the uncompressed model"):
        evaluate_model(str(ref_llama), [], tasks=TaskRequest(names=[TASK], include_path=str(task_dir)), thresholds={"max_task_drop": 0.01})
    # thresholds on the evaluation text, with tasks and no text, would check nothing and pass the gate
    monkeypatch.undo()
    rc, out, _ = run(capsys, "--json", "eval", "--model", ref_llama, "--baseline", ref_llama, "--tasks", TASK,
                     "--include-path", task_dir, "--limit", 2, "--max-kl", 1e-4, "--max-ppl-increase", 0.01)
    assert rc == 2 and "--max-ppl-increase is checked on the evaluation text, and none was given (--data)" in json.loads(out)["error"]


def test_chat_template_puts_prompts_through_the_template(task_dir, ref_llama, instruct_llama, capsys, monkeypatch):
    from lm_eval.models.huggingface import HFLM

    model = instruct_llama
    contexts = []
    scored = HFLM.loglikelihood
    monkeypatch.setattr(HFLM, "loglikelihood", lambda self, requests, **kw: contexts.extend(r.args[0] for r in requests)
                        or scored(self, requests, **kw))
    for flag in ([], ["--chat-template"]):
        rc, out, _ = run(capsys, "--json", "eval", "--model", model, "--tasks", TASK, "--include-path", task_dir, "--limit", 3, *flag)
        assert rc == 0
    plain, chat = contexts[:12], contexts[12:]  # 3 documents x 4 choices each
    assert len(chat) == 12 and not any("<|user|>" in c for c in plain)
    assert all(c.startswith("<s><|user|>\n") and c.rstrip().endswith("</s>\n<|assistant|>") for c in chat)
    rc, _, err = run(capsys, "eval", "--model", ref_llama, "--tasks", TASK, "--include-path", task_dir, "--chat-template")
    assert rc == 2 and "--chat-template (chat_template in a recipe): the model's tokenizer has no chat template" in err


def test_recipe_evaluation_scores_tasks_on_the_output(task_dir, ref_llama, tmp_path, capsys):
    """`evaluation.tasks` in a recipe: the report carries each task's score on the output and on
    the uncompressed model; the output's score equals `compress eval --tasks` on it. The stage
    damages the model (95 % magnitude pruning) so that the two scores differ."""
    recipe = (f"stages:\n  - magnitude: {{sparsity: 0.95}}\n"
              f"evaluation:\n  tasks: {{names: [{TASK}], include_path: {task_dir}, limit: 60}}\n")
    (tmp_path / "r.yaml").write_text(recipe)
    out = tmp_path / "out"
    assert main(["--quiet", "quantize", "--recipe", str(tmp_path / "r.yaml"), "--model", str(ref_llama), "--output", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    r = report["tasks"][TASK]
    assert r["samples"] == 60 and r["score_drop"] == pytest.approx(r["baseline_score"] - r["score"]) and r["score_drop"] > 0
    assert f"| {TASK} | acc | {r['score']:.4f} ± " in (out / "report.md").read_text()
    rc, stdout, _ = run(capsys, "--json", "eval", "--model", out, "--baseline", ref_llama, "--tasks", TASK,
                        "--include-path", task_dir, "--limit", 60)
    assert rc == 0 and json.loads(stdout)["tasks"][TASK] == r
    # the baseline column is the uncompressed model's own score
    rc, stdout, _ = run(capsys, "--json", "eval", "--model", ref_llama, "--tasks", TASK, "--include-path", task_dir, "--limit", 60)
    assert rc == 0 and json.loads(stdout)["tasks"][TASK]["score"] == r["baseline_score"]


def test_recipe_with_an_unknown_task_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    from compress import modeling

    monkeypatch.setattr(modeling, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    (tmp_path / "r.yaml").write_text("stages:\n  - rtn:\n      scheme: W8A16\nevaluation:\n  tasks: [no_such_task]\n")
    rc, _, err = run(capsys, "quantize", "--recipe", tmp_path / "r.yaml", "--model", "default", "--output", tmp_path / "out")
    assert rc == 2 and "unknown lm-eval task: no_such_task" in err and "include_path in a recipe" in err
    assert not (tmp_path / "out").exists()


def test_recipe_asking_for_a_missing_chat_template_fails_before_the_stages(tmp_path, task_dir, ref_llama, capsys, monkeypatch):
    from compress.stages.rtn import RoundToNearest

    monkeypatch.setattr(RoundToNearest, "apply", lambda *a: pytest.fail("the stage ran"))
    (tmp_path / "r.yaml").write_text(f"stages:\n  - rtn:\n      scheme: W8A16\nevaluation:\n  tasks: {{names: [{TASK}], "
                                     f"include_path: {task_dir}, chat_template: true}}\n")
    rc, _, err = run(capsys, "quantize", "--recipe", tmp_path / "r.yaml", "--model", ref_llama, "--output", tmp_path / "out")
    assert rc == 2 and "chat_template in a recipe): the model's tokenizer has no chat template" in err


def test_options_reach_lm_eval_and_the_metric_is_chosen_as_documented(instruct_llama, task_dir, capsys, monkeypatch):
    """--num-fewshot, --limit and --chat-template are what lm-eval is asked for; --task-metric, or
    else the preference acc_norm > acc > exact_match, picks the number reported."""
    import lm_eval

    calls = []

    def fake_evaluate(**kwargs):
        calls.append(kwargs)
        metrics = {"exact_match,none": 0.1, "acc,none": 0.2, "acc_stderr,none": 0.01, "acc_norm,none": 0.3}
        return {"results": {TASK: metrics}, "higher_is_better": {TASK: {"acc": True, "acc_norm": True}},
                "n-samples": {TASK: {"effective": 7}}}

    monkeypatch.setattr(lm_eval, "simple_evaluate", fake_evaluate)
    for extra, metric, value in (([], "acc_norm", 0.3), (["--task-metric", "acc"], "acc", 0.2)):
        rc, out, _ = run(capsys, "--json", "eval", "--model", instruct_llama, "--tasks", TASK, "--include-path", task_dir,
                         "--num-fewshot", 2, "--limit", 7, "--chat-template", *extra)
        r = json.loads(out)["tasks"][TASK]
        assert rc == 0 and (r["metric"], r["score"], r["samples"]) == (metric, value, 7)
    assert all((c["tasks"], c["num_fewshot"], c["limit"], c["apply_chat_template"], c["fewshot_as_multiturn"])
               == ([TASK], 2, 7, True, True) for c in calls)
    from compress.tasks import primary_metric

    assert primary_metric({"exact_match,strict": 1.0, "f1,strict": 0.5}) == "exact_match"
    assert primary_metric({"bleu,none": 30.0, "bleu_stderr,none": 1.0}) == "bleu"


def test_thresholds_at_their_boundary_and_on_unbounded_metrics():
    from compress.evaluate import task_gate
    from compress.tasks import check_thresholds

    row = {"metric": "acc", "score": 0.5, "higher_is_better": True, "score_drop": 0.01}
    assert [c["passed"] for c in task_gate({"t": row}, min_task_score=0.5, max_task_drop=0.01)] == [True, True]
    assert [c["passed"] for c in task_gate({"t": row}, min_task_score=0.51, max_task_drop=0.0099)] == [False, False]
    check_thresholds({"t": {"metric": "bleu", "score": 35.0, "higher_is_better": True}}, None, 5)  # BLEU drops by points


def test_lm_eval_writes_nothing_to_stderr(task_dir, capfd):
    assert main(["--quiet", "eval", "--model", "default", "--tasks", TASK, "--include-path", str(task_dir), "--limit", "2"]) == 0
    assert capfd.readouterr().err == ""  # neither its progress bars nor git's "not a git repository"

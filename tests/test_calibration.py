"""Calibration sets from every supported source, packed and per line."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from compress import modeling
from compress.calibration import build_calibration
from compress.errors import CompressError
from compress.recipe import CalibrationConfig


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR)


TEXT = "\n".join(f"Line {i}: the quick brown fox jumps over the lazy dog near the river bank." for i in range(200))


def test_packed_windows_from_txt(tmp_path, tokenizer):
    f = tmp_path / "c.txt"
    f.write_text(TEXT)
    cal = build_calibration(CalibrationConfig(dataset=str(f), num_samples=8, seq_len=64), tokenizer)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert len(cal.samples) == 8 and cal.num_tokens == 8 * 64
    # consecutive non-overlapping windows from the start, no special tokens
    assert cal.samples[1]["input_ids"][0].tolist() == ids[64:128]
    again = build_calibration(CalibrationConfig(dataset=str(f), num_samples=8, seq_len=64), tokenizer)
    assert again.fingerprint == cal.fingerprint
    # the same ids cut into other windows are another calibration set (it keys the stage cache:
    # 2 windows of 256 reused a stage calibrated on 4 of 128)
    halves = build_calibration(CalibrationConfig(dataset=str(f), num_samples=4, seq_len=128), tokenizer)
    assert torch.equal(torch.cat([x["input_ids"] for x in halves.samples], 1), torch.cat([x["input_ids"] for x in cal.samples], 1))
    assert halves.fingerprint != cal.fingerprint


def test_per_line_fingerprint_tells_where_samples_end(tmp_path):
    class Characters:  # one id per character, so that both files give the same ids
        bos_token = None

        def __call__(self, text, max_length, return_tensors, **_):
            return {"input_ids": torch.tensor([[ord(c) for c in text[:max_length]]])}

    f, joined = tmp_path / "c.txt", tmp_path / "j.txt"
    f.write_text("thequickbrownfox\njumpsoverthelazydog\n")
    joined.write_text("thequickbrownfoxjumps\noverthelazydog\n")
    a, b = (build_calibration(CalibrationConfig(dataset=str(p), num_samples=2, seq_len=64, packing=False, min_chars=1),
                              Characters()) for p in (f, joined))
    ids = lambda cal: torch.cat([x["input_ids"] for x in cal.samples], 1)  # noqa: E731
    assert torch.equal(ids(a), ids(b)) and a.fingerprint != b.fingerprint


@pytest.mark.parametrize("seed", [0, 2**64 + 5, -3])
def test_shuffle_is_seeded(tmp_path, tokenizer, seed):
    """Any integer seeds a draw (torch's generators take 64 bits: 2^64 + 5 was an internal error)."""
    f = tmp_path / "c.txt"
    f.write_text(TEXT)
    cfg = lambda seed: CalibrationConfig(dataset=str(f), num_samples=4, seq_len=32, shuffle=True, seed=seed)  # noqa: E731
    a, b, c = (build_calibration(cfg(s), tokenizer) for s in (seed, seed, seed + 1))
    assert a.fingerprint == b.fingerprint != c.fingerprint


def test_the_runs_seed_draws_a_shuffled_set_unless_the_recipe_fixes_one(tmp_path, tokenizer, capsys):
    """--seed is the shuffled draw's seed when the calibration section names none (it was ignored:
    every --seed drew seed 0's samples while the report said otherwise); a recipe's own seed wins;
    the report and the saved recipe say which seed drew, so the saved recipe repeats the draw."""
    import yaml

    from compress.cli import main

    f = tmp_path / "c.txt"
    f.write_text(TEXT)

    def quantize(name, seed, seed_line=""):
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(f"model: default\ncalibration: {{dataset: {f}, num_samples: 4, seq_len: 32, shuffle: true{seed_line}}}\n"
                          "stages:\n  - rtn: {scheme: W8A8, input_activations: {strategy: tensor, dynamic: false}}\n")
        assert main(["--quiet", "--seed", str(seed), "quantize", "--recipe", str(recipe), "--output", str(tmp_path / name)]) == 0
        capsys.readouterr()
        report = json.loads((tmp_path / name / "report.json").read_text())
        saved = yaml.safe_load((tmp_path / name / "recipe.yaml").read_text())
        return report["calibration"], saved["calibration"]["seed"]

    (s0, saved0), (s1, saved1) = quantize("a", 0), quantize("b", 1)
    assert s0["fingerprint"] != s1["fingerprint"] and (s0["shuffle_seed"], s1["shuffle_seed"]) == (0, 1) == (saved0, saved1)
    assert s1["fingerprint"] == build_calibration(CalibrationConfig(dataset=str(f), num_samples=4, seq_len=32, shuffle=True),
                                                  tokenizer, run_seed=1).fingerprint
    fixed, saved = quantize("c", 1, ", seed: 0")  # the recipe's seed, whatever --seed says
    assert fixed["fingerprint"] == s0["fingerprint"] and fixed["shuffle_seed"] == 0 == saved


def test_jsonl_and_parquet_give_the_same_samples(tmp_path, tokenizer):
    lines = TEXT.splitlines()
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"content": t, "id": i}) for i, t in enumerate(lines)))
    pq.write_table(pa.table({"content": lines}), tmp_path / "c.parquet")
    cfgs = [CalibrationConfig(dataset=str(tmp_path / n), text_field="content", num_samples=16, seq_len=24, packing=False)
            for n in ("c.jsonl", "c.parquet")]
    a, b = (build_calibration(c, tokenizer) for c in cfgs)
    assert a.fingerprint == b.fingerprint and len(a.samples) == 16
    assert a.samples[0]["input_ids"].shape[1] <= 24


def test_parquet_skips_empty_cells_and_names_a_column_that_is_not_text(tmp_path, tokenizer):
    """A numeric column was read as an empty file ("is empty"), sending the user to the file
    rather than to text_field."""
    lines = TEXT.splitlines()[:40]
    pq.write_table(pa.table({"content": [t if i % 2 else None for i, t in enumerate(lines)], "n": list(range(40))}),
                   tmp_path / "c.parquet")
    cfg = dict(dataset=str(tmp_path / "c.parquet"), num_samples=20, seq_len=24, packing=False)
    cal = build_calibration(CalibrationConfig(**cfg, text_field="content"), tokenizer)
    assert len(cal.samples) == 20  # the 20 rows that have text
    with pytest.raises(CompressError, match=r"c.parquet: row 0: 'n' holds int values, not text") as exc:
        build_calibration(CalibrationConfig(**cfg, text_field="n"), tokenizer)
    assert "text_field" in exc.value.hint


def test_a_json_array_reads_as_its_records(tmp_path, tokenizer):
    """`[{"text": ...}, ...]` was read as JSON Lines and refused at line 1 for lacking 'text'."""
    lines = TEXT.splitlines()[:20]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in lines))
    (tmp_path / "a.json").write_text("\ufeff" + json.dumps([{"text": t} for t in lines], indent=2))  # with a BOM, as some editors save
    (tmp_path / "s.json").write_text(json.dumps(lines))
    a, b, c = (build_calibration(CalibrationConfig(dataset=str(tmp_path / n), num_samples=20, seq_len=24, packing=False), tokenizer)
               for n in ("c.jsonl", "a.json", "s.json"))
    assert a.fingerprint == b.fingerprint == c.fingerprint
    (tmp_path / "b.json").write_text(json.dumps([{"text": "fine"}, {"body": "x"}]))
    with pytest.raises(CompressError, match=r"b.json: record 1: no string or conversation field 'text'"):
        build_calibration(CalibrationConfig(dataset=str(tmp_path / "b.json"), num_samples=1, seq_len=24), tokenizer)


def test_list_of_files_is_concatenated(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text(TEXT[:2000])
    (tmp_path / "b.txt").write_text(TEXT[2000:])
    cal = build_calibration(CalibrationConfig(dataset=[str(tmp_path / "a.txt"), str(tmp_path / "b.txt")],
                                              num_samples=10, seq_len=64), tokenizer)
    assert len(cal.samples) == 10 and "a.txt" in cal.source and "b.txt" in cal.source


def test_too_short_names_the_file_and_counts(tmp_path, tokenizer):
    f = tmp_path / "short.txt"
    f.write_text("just a few words")
    with pytest.raises(CompressError, match=r"short.txt gives 0 windows of 256 tokens, 128 asked"):
        build_calibration(CalibrationConfig(dataset=str(f)), tokenizer)


def test_bundled_corpus_found_from_any_directory(tokenizer, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cal = build_calibration(CalibrationConfig(), tokenizer)  # calibration/default.txt, 128 x 256
    assert len(cal.samples) == 128 and all(s["input_ids"].shape == (1, 256) for s in cal.samples)


def test_hub_dataset_unreachable_is_a_clear_error(tokenizer):
    with pytest.raises(CompressError, match=r"cannot load dataset 'nonexistent-org/nonexistent-dataset' from the hub \(nor is it a local file\)"):
        build_calibration(CalibrationConfig(dataset="nonexistent-org/nonexistent-dataset"), tokenizer)


def _shared_corpus():
    import os
    from pathlib import Path

    shared = Path(os.environ.get("COMPRESS_SHARED", modeling.REPO_DIR.parent / "shared"))
    files = [shared / "data/tinyshakespeare/train.txt", shared / "data/wikitext-2/train.txt"]
    if not all(f.is_file() for f in files):
        pytest.skip(f"shared/ not found at {shared} (set COMPRESS_SHARED)")
    return "\n\n".join(f.read_text() for f in files)


@pytest.mark.parametrize("seq_len,count", [(256, 128), (256, 1500), (64, 7)])
def test_leading_windows_equal_the_whole_texts(tokenizer, seq_len, count):
    """Tokenizing only a prefix gives exactly the windows the whole corpus gives (the benchmark's
    calibration: Tiny Shakespeare then WikiText-2, 128 windows of 256; and more windows than
    Tiny Shakespeare holds, so the prefix crosses into WikiText-2)."""
    from compress.calibration import leading_windows, token_windows

    text = _shared_corpus()
    prefix = leading_windows(tokenizer, text, seq_len, count)
    assert prefix is not None and prefix.shape == (count, seq_len)
    assert torch.equal(prefix, token_windows(tokenizer, text, seq_len)[:count])


CHATS = [[{"role": "user", "content": f"Question {i}: what follows {i}?"},
          {"role": "assistant", "content": f"The number {i + 1} follows {i}, as it always has."}] for i in range(40)]


@pytest.fixture(scope="module")
def chat_tokenizer(instruct_llama):
    return AutoTokenizer.from_pretrained(instruct_llama)


def test_conversations_are_rendered_with_the_chat_template(tmp_path, chat_tokenizer):
    f = tmp_path / "chat.jsonl"
    f.write_text("\n".join(json.dumps({"messages": m, "id": i}) for i, m in enumerate(CHATS)))
    cal = build_calibration(CalibrationConfig(dataset=str(f), text_field="messages", num_samples=8, seq_len=64,
                                              packing=False), chat_tokenizer)
    expect = chat_tokenizer.apply_chat_template(CHATS[3], tokenize=False)
    assert expect.startswith("<s><|user|>\nQuestion 3") and "</s>\n<|assistant|>" in expect
    ids = cal.samples[3]["input_ids"][0].tolist()
    assert ids == chat_tokenizer(expect.strip(), add_special_tokens=False)["input_ids"][:64]
    assert ids.count(chat_tokenizer.bos_token_id) == 1  # the template's BOS, not a second one
    # packed: the rendered conversations joined and cut into windows, like plain text
    packed = build_calibration(CalibrationConfig(dataset=str(f), text_field="messages", num_samples=4, seq_len=32),
                               chat_tokenizer)
    joined = "\n\n".join(chat_tokenizer.apply_chat_template(m, tokenize=False) for m in CHATS)
    assert packed.samples[1]["input_ids"][0].tolist() == chat_tokenizer(joined, add_special_tokens=False)["input_ids"][32:64]


def test_conversations_from_a_hub_dataset(monkeypatch, chat_tokenizer):
    import datasets

    seen = {}

    def fake_load(name, config_name=None, split=None, streaming=False):
        seen.update(name=name, split=split, streaming=streaming)
        return datasets.Dataset.from_dict({"messages": CHATS, "prompt": [c[0]["content"] for c in CHATS]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    cfg = CalibrationConfig(dataset="org/chat-data", split="train_sft", text_field="messages", num_samples=5,
                            seq_len=48, packing=False)
    cal = build_calibration(cfg, chat_tokenizer)
    assert seen == {"name": "org/chat-data", "split": "train_sft", "streaming": False} and len(cal.samples) == 5
    first = chat_tokenizer.decode(cal.samples[0]["input_ids"][0])
    assert first.startswith("<s><|user|>") and "Question 0" in first


def test_conversations_need_a_chat_template(tmp_path, tokenizer):
    f = tmp_path / "chat.jsonl"
    f.write_text("\n".join(json.dumps({"messages": m}) for m in CHATS))
    assert not tokenizer.chat_template
    with pytest.raises(CompressError, match=r"chat.jsonl:1: holds chat messages, but the model's tokenizer has no chat template"):
        build_calibration(CalibrationConfig(dataset=str(f), text_field="messages", num_samples=4, packing=False), tokenizer)


def test_malformed_message_names_the_record(tmp_path, chat_tokenizer):
    f = tmp_path / "chat.jsonl"
    bad = [{"role": "user", "content": "hi"}, {"role": "assistant", "text": "hello"}]
    f.write_text("\n".join(json.dumps({"messages": m}) for m in [CHATS[0], bad]))
    with pytest.raises(CompressError, match=r"chat.jsonl:2: message 1 is not \{role: str, content: str\} \(keys: role, text\)"):
        build_calibration(CalibrationConfig(dataset=str(f), text_field="messages", num_samples=2, packing=False), chat_tokenizer)


def test_instruct_model_quantized_on_conversations(tmp_path, instruct_llama):
    """GPTQ through the CLI calibrated on a chat .jsonl, with the template from the model's own
    tokenizer_config.json; the output keeps the template for the next tool."""
    import yaml

    from compress.cli import main

    model = instruct_llama
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps({"messages": m}) for m in CHATS))
    recipe = {"calibration": {"dataset": str(tmp_path / "chat.jsonl"), "text_field": "messages", "packing": False,
                              "num_samples": 8, "seq_len": 64},
              "stages": [{"gptq": {"scheme": "W4A16", "weights": {"group_size": 64}}}]}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    out = tmp_path / "out"
    assert main(["--quiet", "quantize", "--recipe", str(tmp_path / "r.yaml"), "--model", str(model), "--output", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["calibration"]["num_samples"] == 8 and report["calibration"]["source"].endswith("chat.jsonl")
    # one sample per conversation (each under 64 tokens), not 8 windows of 64
    tok = AutoTokenizer.from_pretrained(model)
    lengths = [len(tok(tok.apply_chat_template(m, tokenize=False).strip(), add_special_tokens=False)["input_ids"]) for m in CHATS[:8]]
    assert max(lengths) < 64 and report["calibration"]["tokens"] == sum(lengths)
    assert all(r["gptq_loss"] < r["rtn_loss"] for r in report["layers"].values())
    assert AutoTokenizer.from_pretrained(out).chat_template == AutoTokenizer.from_pretrained(model).chat_template


def _fake_hub(monkeypatch, records: list[dict]) -> list[int]:
    """datasets.load_dataset serving `records`; returns the indices a stream handed out."""
    import datasets

    served = []

    def gen():
        for i, r in enumerate(records):
            served.append(i)
            yield r

    def fake_load(name, config_name=None, split=None, streaming=False):
        return datasets.IterableDataset.from_generator(gen) if streaming else datasets.Dataset.from_list(records)

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    return served


def test_streaming_reads_only_what_the_samples_need(monkeypatch, tokenizer):
    records = [{"text": line, "id": i} for i, line in enumerate(TEXT.splitlines())] * 20  # 4,000 records
    served = _fake_hub(monkeypatch, records)
    cfg = dict(dataset="allenai/c4", num_samples=6, seq_len=64)
    whole = build_calibration(CalibrationConfig(**cfg), tokenizer)
    streamed = build_calibration(CalibrationConfig(**cfg, streaming=True), tokenizer)
    assert streamed.fingerprint == whole.fingerprint  # the same first windows
    assert 0 < len(served) < 40  # each record is ~20 tokens: 6 x 64 + 64 tokens need about 23 of 4,000

    served.clear()
    unpacked = dict(dataset="allenai/c4", num_samples=5, seq_len=32, packing=False, min_chars=72)
    one_each = build_calibration(CalibrationConfig(**unpacked, streaming=True), tokenizer)
    assert one_each.fingerprint == build_calibration(CalibrationConfig(**unpacked), tokenizer).fingerprint
    assert len(one_each.samples) == 5 and len(served) == 15  # lines 0-9 have 72 characters, 10-14 are taken


@pytest.mark.parametrize("seed", [0, -3, 2**64 + 5])  # datasets' shuffle takes non-negative seeds only
def test_streaming_with_shuffle_is_seeded(monkeypatch, tokenizer, seed):
    _fake_hub(monkeypatch, [{"text": line} for line in TEXT.splitlines()])
    cfg = lambda seed: CalibrationConfig(dataset="org/big", num_samples=4, seq_len=32, streaming=True,  # noqa: E731
                                         shuffle=True, seed=seed)
    a, b, c = (build_calibration(cfg(s), tokenizer) for s in (seed, seed, seed + 1))
    first = build_calibration(CalibrationConfig(dataset="org/big", num_samples=4, seq_len=32, streaming=True), tokenizer)
    assert a.fingerprint == b.fingerprint != c.fingerprint and a.fingerprint != first.fingerprint


def test_streaming_missing_field_names_the_fields(monkeypatch, tokenizer):
    _fake_hub(monkeypatch, [{"content": "x" * 100}] * 10)
    with pytest.raises(CompressError, match=r"dataset 'org/big' has no field 'text' \(fields: content\)"):
        build_calibration(CalibrationConfig(dataset="org/big", num_samples=2, seq_len=8, streaming=True), tokenizer)


def test_streaming_counts_local_files_and_names_only_sources_read(monkeypatch, tokenizer, tmp_path):
    local = tmp_path / "local.txt"
    local.write_text(TEXT)  # 4,000 tokens: 6 windows of 64 and the margin, with room to spare
    served = _fake_hub(monkeypatch, [{"text": line} for line in TEXT.splitlines()])
    cfg = CalibrationConfig(dataset=[str(local), "org/a"], num_samples=6, seq_len=64, streaming=True)
    cal = build_calibration(cfg, tokenizer)
    assert served == [] and cal.source == str(local)
    # hub first: enough from it, so the local file is not read, and not named
    cal = build_calibration(CalibrationConfig(dataset=["org/a", str(local)], num_samples=6, seq_len=64, streaming=True), tokenizer)
    assert 0 < len(served) < 40 and cal.source == "org/a"


def test_empty_conversations_are_skipped_in_every_format(tmp_path, chat_tokenizer):
    records = [CHATS[0], [], CHATS[1]]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"messages": m}) for m in records))
    pq.write_table(pa.table({"messages": records}), tmp_path / "c.parquet")
    for name in ("c.jsonl", "c.parquet"):
        cal = build_calibration(CalibrationConfig(dataset=str(tmp_path / name), text_field="messages", num_samples=2,
                                                  seq_len=64, packing=False), chat_tokenizer)
        assert "Question 1" in chat_tokenizer.decode(cal.samples[1]["input_ids"][0]), name


def test_evaluation_data_may_hold_conversations(tmp_path, ref_llama, instruct_llama, chat_tokenizer, capsys, monkeypatch):
    """eval renders them with the model's template: the same numbers as the rendered text in a .txt;
    a model without a template is refused before any stage runs."""
    from compress.cli import main

    model = instruct_llama
    chats = CHATS * 3
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps({"text": m}) for m in chats))
    (tmp_path / "chat.txt").write_text("\n".join(chat_tokenizer.apply_chat_template(m, tokenize=False) for m in chats))
    results = []
    for data in ("chat.jsonl", "chat.txt"):
        assert main(["--json", "eval", "--model", str(model), "--data", str(tmp_path / data), "--seq-len", "64",
                     "--max-windows", "8"]) == 0
        results.append(next(iter(json.loads(capsys.readouterr().out)["results"].values())))
    assert results[0] == results[1] and results[0]["windows"] == 8

    from compress.stages.rtn import RoundToNearest

    monkeypatch.setattr(RoundToNearest, "apply", lambda *a: pytest.fail("the stage ran"))
    (tmp_path / "r.yaml").write_text(f"stages:\n  - rtn:\n      scheme: W8A16\nevaluation:\n  datasets: [{tmp_path / 'chat.jsonl'}]\n")
    assert main(["quantize", "--recipe", str(tmp_path / "r.yaml"), "--model", str(ref_llama), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "chat.jsonl:1: holds chat messages, but the model's tokenizer has no chat template" in err
    assert not (tmp_path / "out").exists()


def test_streaming_a_list_reads_on_while_samples_are_missing(monkeypatch, tokenizer):
    import datasets

    served = {"org/a": 0, "org/b": 0}
    lines = TEXT.splitlines()

    def fake_load(name, config_name=None, split=None, streaming=False):
        part = lines[:5] if name == "org/a" else lines[5:]  # org/a alone is far too short

        def gen():
            for line in part:
                served[name] += 1
                yield {"text": line}

        return datasets.IterableDataset.from_generator(gen) if streaming else datasets.Dataset.from_list([{"text": t} for t in part])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    cfg = dict(dataset=["org/a", "org/b"], num_samples=6, seq_len=64)
    streamed = build_calibration(CalibrationConfig(**cfg, streaming=True), tokenizer)
    assert streamed.source == "org/a, org/b" and served["org/a"] == 5 and 0 < served["org/b"] < 40
    assert streamed.fingerprint == build_calibration(CalibrationConfig(**cfg), tokenizer).fingerprint


def test_a_stream_that_fails_mid_read_is_a_clear_error(monkeypatch, tokenizer):
    import datasets

    def gen():
        yield {"text": "first"}
        raise ConnectionError("connection reset by peer")

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.IterableDataset.from_generator(gen))
    with pytest.raises(CompressError, match=r"cannot stream dataset 'org/big' from the hub: .*connection reset"):
        build_calibration(CalibrationConfig(dataset="org/big", num_samples=2, seq_len=8, streaming=True), tokenizer)


def test_one_bos_where_both_the_template_and_the_tokenizer_add_it(tmp_path, instruct_llama):
    """Llama-style tokenizers add BOS themselves and their templates write it too: a conversation
    gets one, plain text still gets the tokenizer's."""
    import shutil

    model = tmp_path / "bos"
    shutil.copytree(instruct_llama, model, ignore=shutil.ignore_patterns("*.safetensors"))
    spec = json.loads((model / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    spec["post_processor"]["single"] = [bos, *spec["post_processor"]["single"]]
    spec["post_processor"]["special_tokens"] = {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}
    (model / "tokenizer.json").write_text(json.dumps(spec))
    tok = AutoTokenizer.from_pretrained(model)
    assert tok("hello")["input_ids"][0] == tok.bos_token_id  # it does add BOS
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps({"messages": m}) for m in CHATS[:4]))
    cal = build_calibration(CalibrationConfig(dataset=str(tmp_path / "chat.jsonl"), text_field="messages", num_samples=4,
                                              seq_len=64, packing=False), tok)
    assert all(s["input_ids"][0].tolist().count(tok.bos_token_id) == 1 for s in cal.samples)
    (tmp_path / "plain.txt").write_text("\n".join(TEXT.splitlines()[:4]))
    plain = build_calibration(CalibrationConfig(dataset=str(tmp_path / "plain.txt"), num_samples=4, seq_len=64, packing=False), tok)
    assert all(s["input_ids"][0, 0] == tok.bos_token_id for s in plain.samples)

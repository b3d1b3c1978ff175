"""Calibration sets: text from a local file or a hub dataset, tokenized into samples.

Packed (causal LMs): the texts are joined, tokenized without special tokens and cut into
consecutive non-overlapping windows of `seq_len` tokens; the first `num_samples` windows are taken
(or a seeded random choice with `shuffle`). Unpacked (encoders, or one conversation per sample):
one sample per line or record, truncated at `seq_len`. The fingerprint (sha256 of the samples'
lengths and token ids) goes into the report and keys the stage cache.

A record's field may hold a conversation instead of text, a list of {role, content} messages as
in chat datasets such as ultrachat: it is rendered with the tokenizer's chat template, so an
instruct model is calibrated on the prompts it will serve.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from compress.errors import CompressError, first_line
from compress.modeling import bundled_file
from compress.seeding import SEED_RANGE, seeded_generator

FILE_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")


@dataclass
class CalibrationSet:
    samples: list[dict[str, torch.Tensor]]  # model inputs, one batch of 1 per sample
    fingerprint: str
    source: str
    num_tokens: int


# Where a file's text is when it is not in the `text` field: only recipes can say.
TEXT_FIELD_HINT = "the field holding the text: calibration.text_field in a recipe (compress eval reads 'text')"


def resolve_data_path(spec: str) -> Path | None:
    """A local file: as given, else the bundled one of that name (`calibration/default.txt`)."""
    p = Path(spec).expanduser()
    if p.exists():
        return p
    return bundled_file(p)


def is_local_spec(spec: str) -> bool:
    return spec.endswith(FILE_SUFFIXES) or spec.startswith((".", "/", "~")) or resolve_data_path(spec) is not None


STREAM_SHUFFLE_BUFFER = 10_000  # records: a streamed split is shuffled within a window this large


@dataclass
class StreamBudget:
    """Read hub datasets as streams, record by record, and stop once `need` is reached: a corpus
    too big to download whole (allenai/c4) gives its first samples in seconds. `count` says what a
    text counts for: its tokens (packed windows) or one sample."""

    count: Callable[[str], int]
    need: int
    shuffle_seed: int | None = None  # shuffle the stream within STREAM_SHUFFLE_BUFFER records
    got: int = 0

    def take(self, text: str) -> bool:
        self.got += self.count(text)
        return self.done

    @property
    def done(self) -> bool:
        return self.got >= self.need


def read_texts(spec: str, text_field: str = "text", split: str = "train", config_name: str | None = None,
               lines: bool = False, tokenizer=None, stream: StreamBudget | None = None) -> list[str]:
    """Texts of a local .txt/.jsonl/.parquet file or a hub dataset. `lines` splits .txt by line.
    Conversations are rendered with `tokenizer`'s chat template. With `stream`, a hub dataset is
    read only until the budget is met (a local file is read whole, and counts towards it)."""
    path = resolve_data_path(spec)
    if path is None and is_local_spec(spec):
        raise CompressError(f"calibration/evaluation file not found: {spec}", "check the path; relative paths are tried from the current directory, then the project root")
    if path is not None:
        if path.is_dir():
            raise CompressError(f"{spec} is a directory", "give a .txt, .jsonl or .parquet file")
        texts = _read_file(path, text_field, lines, tokenizer)
        if stream is not None:
            # Read whole, but it counts: a hub dataset after it is read only for what is still missing.
            for text in texts:
                if stream.take(text):
                    break
        return texts
    return _read_hub(spec, text_field, split, config_name, tokenizer, stream)


def is_conversation(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) for m in value)


def render_conversation(messages: list[dict], tokenizer, where: str) -> str:
    """One conversation as the model sees it in use: the tokenizer's chat template, whole. An empty
    one is empty text, skipped like an empty line."""
    if not messages:
        return ""
    for n, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise CompressError(f"{where}: message {n} is not {{role: str, content: str}} (keys: {', '.join(map(str, m)) or 'none'})",
                                "give each message a string role and a string content")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise CompressError(f"{where}: holds chat messages, but the model's tokenizer has no chat template",
                            "use the instruct model's tokenizer (its tokenizer_config.json has chat_template), "
                            "or point text_field at a plain-text field")
    return tokenizer.apply_chat_template(messages, tokenize=False)


def _record_text(value, tokenizer, where: str) -> str | None:
    """A record's text: the string, or its conversation rendered; None for anything else."""
    if isinstance(value, str):
        return value
    return render_conversation(value, tokenizer, where) if is_conversation(value) else None


def _column_text(value, tokenizer, where: str, text_field: str) -> str | None:
    """A table row's text (parquet, hub datasets): None for an empty (null) cell, which tables
    often hold; a value of another kind (a number, a list of ids) means the wrong column."""
    if value is None:
        return None
    text = _record_text(value, tokenizer, where)
    if text is None:
        raise CompressError(f"{where}: '{text_field}' holds {type(value).__name__} values, not text or a conversation",
                            TEXT_FIELD_HINT)
    return text


def _read_file(path: Path, text_field: str, lines: bool, tokenizer=None) -> list[str]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path)
            if text_field not in table.column_names:
                raise CompressError(f"{path}: no column '{text_field}' (columns: {', '.join(table.column_names)})", TEXT_FIELD_HINT)
            texts = [_column_text(v, tokenizer, f"{path}: row {n}", text_field)
                     for n, v in enumerate(table.column(text_field).to_pylist())]
            texts = [t for t in texts if t is not None]
        elif suffix == ".json" and _starts_with(path, "["):
            texts = _json_array_texts(path, text_field, tokenizer)
        elif suffix in (".jsonl", ".json"):
            texts = []
            with open(path, encoding="utf-8-sig") as fh:  # a byte-order mark is not JSON
                for n, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise CompressError(f"{path}:{n}: not valid JSON ({exc.msg})", "each line must be one JSON object") from None
                    texts.append(_json_record_text(record, text_field, tokenizer, f"{path}:{n}"))
        else:
            raw = path.read_bytes()
            if b"\x00" in raw[:8192]:
                raise CompressError(f"{path}: looks like binary data, not text", "give a UTF-8 text file")
            text = raw.decode("utf-8")
            texts = text.splitlines() if lines else [text]
    except UnicodeDecodeError:
        raise CompressError(f"{path}: not UTF-8 text", "convert the file to UTF-8") from None
    except CompressError:
        raise
    except Exception as exc:  # pyarrow errors on a damaged file
        raise CompressError(f"{path}: cannot read: {first_line(exc)}",
                            "the file may be damaged; give a valid .parquet file, or the text as .txt/.jsonl") from None
    return texts


def _starts_with(path: Path, char: str) -> bool:
    with open(path, encoding="utf-8-sig") as fh:
        return fh.read(4096).lstrip().startswith(char)


def _json_array_texts(path: Path, text_field: str, tokenizer=None) -> list[str]:
    """A .json file holding one array of records (or of strings), as datasets are often shared;
    a .json file of one object per line is read as JSON Lines."""
    try:
        records = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as exc:
        raise CompressError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})",
                            "give one JSON array of records, or one JSON object per line") from None
    return [record if isinstance(record, str) else _json_record_text(record, text_field, tokenizer, f"{path}: record {n}")
            for n, record in enumerate(records)]


def _json_record_text(record, text_field: str, tokenizer, where: str) -> str:
    """A JSON record's text (its field's string or rendered conversation), or a one-line error."""
    text = _record_text(record.get(text_field), tokenizer, where) if isinstance(record, dict) else None
    if text is None:
        raise CompressError(f"{where}: no string or conversation field '{text_field}'", TEXT_FIELD_HINT)
    return text


def _read_hub(name: str, text_field: str, split: str, config_name: str | None, tokenizer=None,
              stream: StreamBudget | None = None) -> list[str]:
    unreachable = "check the name and your network; offline, use a local .txt/.jsonl/.parquet file"
    try:
        import datasets

        datasets.disable_progress_bars()  # as transformers' (compress.cli): a run draws its own bars
        ds = datasets.load_dataset(name, config_name, split=split, streaming=stream is not None)
    except Exception as exc:
        raise CompressError(f"cannot load dataset '{name}' from the hub (nor is it a local file): {first_line(exc)}",
                            unreachable) from None
    fields = ds.column_names  # a stream may not know its columns before the first record
    if fields is not None and text_field not in fields:
        raise CompressError(f"dataset '{name}' has no field '{text_field}' (fields: {', '.join(fields)})", TEXT_FIELD_HINT)
    if stream is None:
        texts = [_column_text(v, tokenizer, f"dataset '{name}' record {n}", text_field) for n, v in enumerate(ds[text_field])]
        return [t for t in texts if t is not None]
    if stream.shuffle_seed is not None:
        ds = ds.shuffle(seed=stream.shuffle_seed % SEED_RANGE, buffer_size=STREAM_SHUFFLE_BUFFER)  # any integer seed
    texts = []
    try:
        for n, record in enumerate(ds):
            if text_field not in record:
                raise CompressError(f"dataset '{name}' has no field '{text_field}' (fields: {', '.join(record)})", TEXT_FIELD_HINT)
            text = _column_text(record[text_field], tokenizer, f"dataset '{name}' record {n}", text_field)
            if text is not None:
                texts.append(text)
                if stream.take(text):
                    break
    except CompressError:
        raise
    except Exception as exc:  # a stream fails on its first read, not on load_dataset
        raise CompressError(f"cannot stream dataset '{name}' from the hub: {first_line(exc)}", unreachable) from None
    return texts


def token_windows(tokenizer, text: str, seq_len: int) -> torch.Tensor:
    """[n_windows, seq_len] consecutive non-overlapping windows, remainder dropped."""
    # verbose=False: the whole file is longer than the model's context on purpose; it is cut into windows next.
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).reshape(n, seq_len)


def special_frame(tokenizer) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a text (BERT: [CLS] and [SEP])."""
    framed = tokenizer("word", add_special_tokens=True, verbose=False)["input_ids"]
    bare = tokenizer("word", add_special_tokens=False, verbose=False)["input_ids"]
    start = next(i for i in range(len(framed) - len(bare) + 1) if framed[i : i + len(bare)] == bare)
    return framed[:start], framed[start + len(bare):]


def text_windows(tokenizer, text: str, seq_len: int, count: int | None, encoder: bool, key: str = "seq_len") -> torch.Tensor:
    """[n, seq_len] consecutive windows of `text`: the first `count` (tokenizing only what they
    need, leading_windows) or, with `count` None, all of them. A causal LM's are text alone, as
    the benchmark protocol cuts them; an `encoder`'s are framed by its tokenizer's special tokens
    ([CLS] text [SEP]), as every input it embeds is, so that calibration statistics and training
    targets come from inputs like the ones it serves. `key` names seq_len in an error."""
    before, after = special_frame(tokenizer) if encoder else ([], [])
    inner = seq_len - len(before) - len(after)
    if inner < 1:
        raise CompressError(f"{key} {seq_len} leaves no room for text between the tokenizer's {len(before) + len(after)} "
                            "special tokens", f"raise {key.rsplit(' ', 1)[-1]}")
    ids = leading_windows(tokenizer, text, inner, count) if count else None
    if ids is None:
        ids = token_windows(tokenizer, text, inner)
    if before or after:
        frame = [torch.tensor(t, dtype=torch.long).expand(len(ids), -1) for t in (before, after)]
        ids = torch.cat([frame[0], ids, frame[1]], dim=1)
    return ids


WINDOW_MARGIN = 64  # tokens past the last window: far enough that a cut there cannot change it


def leading_windows(tokenizer, text: str, seq_len: int, count: int, margin: int = WINDOW_MARGIN) -> torch.Tensor | None:
    """The first `count` windows of token_windows(text), tokenizing only as much of the text as
    they need: a prefix cut at a line break, doubled until it yields `count` windows plus `margin`
    tokens. Tokens that far before the cut do not depend on it (the pre-tokenizer splits at
    whitespace), so the windows equal the whole text's (tested on the benchmark's corpus). None
    when the prefix would be the whole text anyway. Tokenizing a large corpus whole costs time and
    memory that grow with the corpus, not with the samples asked for."""
    need = seq_len * count
    if need <= 0:  # nothing asked: doubling a zero guess would never end
        return None
    chars = need * 4  # a first guess; small vocabularies give under 3 characters per token
    while chars < len(text):
        cut = text.rfind("\n", 0, chars)
        cut = cut if cut > chars // 2 else chars
        ids = tokenizer(text[:cut], add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
        if len(ids) - margin >= need:
            return torch.tensor(ids[:need], dtype=torch.long).reshape(count, seq_len)
        chars *= 2
    return None


def _stream_budget(cfg, tokenizer, seed: int) -> StreamBudget:
    """What a streamed calibration set must read: enough tokens for the windows, plus the margin
    leading_windows wants past the last one (records are counted apart; joined they give at
    least as many), or enough records longer than min_chars."""
    seed = seed if cfg.shuffle else None
    if cfg.packing:
        return StreamBudget(lambda t: len(tokenizer(t, add_special_tokens=False, verbose=False)["input_ids"]),
                            cfg.num_samples * cfg.seq_len + WINDOW_MARGIN, seed)
    return StreamBudget(lambda t: int(len(t.strip()) > cfg.min_chars), cfg.num_samples, seed)


def draw_seed(cfg, run_seed: int = 0) -> int:
    """The seed of a shuffled draw: the section's own `seed`, else the run's (--seed)."""
    return run_seed if cfg.seed is None else cfg.seed


def build_calibration(cfg, tokenizer, run_seed: int = 0, encoder: bool = False) -> CalibrationSet:
    """Tokenize a recipe's `calibration` section into samples; a shuffled draw uses
    draw_seed(cfg, run_seed). An `encoder`'s packed windows are framed by its special tokens."""
    seed = draw_seed(cfg, run_seed)
    specs = [cfg.dataset] if isinstance(cfg.dataset, str) else list(cfg.dataset)
    stream = _stream_budget(cfg, tokenizer, seed) if cfg.streaming else None
    read = []  # the sources read: streaming stops before the rest

    def gather(lines: bool) -> list[str]:
        texts = []
        for spec in specs:
            if stream is not None and stream.done:
                break
            texts += read_texts(spec, cfg.text_field, cfg.split, cfg.config_name, lines=lines, tokenizer=tokenizer, stream=stream)
            read.append(spec)
        return texts

    if cfg.packing:
        texts = gather(lines=False)
        source = ", ".join(read)
        text = "\n\n".join(t for t in texts if t.strip())
        if not text.strip():
            raise CompressError(f"calibration data {source} is empty", "give a file with text in it")
        # shuffled, every window is a candidate
        windows = text_windows(tokenizer, text, cfg.seq_len, None if cfg.shuffle else cfg.num_samples, encoder,
                               "calibration.seq_len")
        if len(windows) < cfg.num_samples:
            raise CompressError(
                f"calibration data {source} gives {len(windows)} windows of {cfg.seq_len} tokens, "
                f"{cfg.num_samples} asked",
                "lower num_samples or seq_len, or give more text",
            )
        if cfg.shuffle:
            g = seeded_generator(seed)
            idx = torch.randperm(len(windows), generator=g)[: cfg.num_samples].sort().values
        else:
            idx = torch.arange(cfg.num_samples)
        chosen = windows[idx]
        samples = [{"input_ids": row.unsqueeze(0)} for row in chosen]
        # the window shape too: 4 windows of 128 and 2 of 256 are the same ids in other contexts
        digest = hashlib.sha256(f"{tuple(chosen.shape)}".encode() + chosen.numpy().tobytes()).hexdigest()
        return CalibrationSet(samples, digest, source, int(chosen.numel()))

    texts = [t.strip() for t in gather(lines=True)]
    source = ", ".join(read)
    texts = [t for t in texts if t and len(t) > cfg.min_chars]
    if len(texts) < cfg.num_samples:
        raise CompressError(
            f"calibration data {source} has {len(texts)} lines/records longer than {cfg.min_chars} characters, "
            f"{cfg.num_samples} asked",
            "lower num_samples or min_chars, or give more text",
        )
    if cfg.shuffle:
        g = seeded_generator(seed)
        texts = [texts[i] for i in torch.randperm(len(texts), generator=g)[: cfg.num_samples].sort().values.tolist()]
    else:
        texts = texts[: cfg.num_samples]
    h = hashlib.sha256()
    samples = []
    total = 0
    bos = getattr(tokenizer, "bos_token", None)
    for t in texts:
        # A rendered conversation already begins with the BOS token where the template writes one.
        add_special = not (bos and t.startswith(bos))
        enc = tokenizer(t, truncation=True, max_length=cfg.seq_len, return_tensors="pt", add_special_tokens=add_special)
        sample = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        samples.append(sample)
        h.update(f"{sample['input_ids'].shape[-1]}:".encode() + sample["input_ids"].numpy().tobytes())  # where it ends too
        total += int(sample["input_ids"].numel())
    return CalibrationSet(samples, h.hexdigest(), source, total)

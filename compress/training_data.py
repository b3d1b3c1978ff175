"""Training sequences for distillation and QAT: windows of a text corpus or dataset, or sequences
the teacher writes itself.

Teacher-generated data follows LLM-QAT (Liu et al. 2023): with no access to the training corpus,
start each sequence from a random vocabulary token and let the teacher continue it by top-k
sampling; the student then learns the teacher's distribution where the teacher puts its mass.
Where the teacher ends a text (its EOS, or an end of turn its generation_config lists), the row
goes on with a new text from a new random token, as documents are packed into a pretraining
window: what a model writes after its end token is not text.
Generation is the slow part, so the sequences are cached on disk under a key made of the
teacher's weights hash and the generation settings, and reused by the next run.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from pathlib import Path
from typing import Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from compress.calibration import TEXT_FIELD_HINT, read_texts, text_windows
from compress.errors import CompressError
from compress.seeding import seeded_generator


class GenerateConfig(BaseModel):
    """`data.generate`: sequences sampled from the teacher instead of a corpus."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    num_sequences: int = Field(256, gt=0, description="sequences to generate, the held-out eval_samples included")
    top_k: int = Field(50, gt=0, description="sample among the teacher's k most likely next tokens")
    temperature: float = Field(1.0, gt=0, description="sampling temperature")
    greedy_tokens: int = Field(0, ge=0, description="the first N tokens after the random first one are the teacher's most "
                               "likely, the rest sampled (LLM-QAT's hybrid sampling; it found 3 to 5 best)")
    batch_size: int = Field(32, gt=0, description="sequences generated at once")
    cache_dir: Optional[str] = Field(None, description="where generated sequences are kept; default ~/.cache/compress/generated or $COMPRESS_CACHE/generated")


class TrainingData(BaseModel):
    """A training stage's `data:` keys."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    dataset: Optional[Union[str, list[str]]] = Field(
        None, description="text file(s) or hub dataset; default: the recipe's calibration set")
    config_name: Optional[str] = Field(None, description="hub dataset configuration")
    split: str = Field("train", description="hub dataset split")
    text_field: str = Field("text", description="field holding the text, or a conversation (rendered with the chat template)")
    seq_len: int = Field(256, gt=1, description="tokens per training sequence")
    num_samples: Optional[int] = Field(None, gt=0, description="training sequences (default: every window the text gives)")
    shuffle: bool = Field(False, description="take num_samples windows at random (seeded) from the whole text, not the first ones: "
                          "with several corpora concatenated, the first windows all come from the first")
    eval_samples: int = Field(16, ge=1, description="sequences held out (taken from the end) for evaluation during training")
    generate: Optional[GenerateConfig] = Field(None, description="sequences the teacher writes itself (LLM-QAT) instead of a text")

    @field_validator("dataset")
    @classmethod
    def _dataset_named(cls, value):
        from compress.recipe import named_datasets

        return value if value is None else named_datasets(value)

    @model_validator(mode="after")
    def _keys_apply(self) -> "TrainingData":
        """Keys of a text corpus given without one were silently ignored (the calibration windows
        were trained on instead; data.seq_len against calibration.seq_len: the recipe's check)."""
        if self.dataset is None:  # (a saved recipe.yaml spells every default out: those are not "given")
            given = [k for k in ("config_name", "split", "text_field", "shuffle")
                     if k in self.model_fields_set and getattr(self, k) != type(self).model_fields[k].default]
            if given:
                source = "generate (the teacher's sequences)" if self.generate is not None else "the calibration windows"
                raise ValueError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to data.dataset, and none is "
                                 f"given: the stage trains on {source}")
        return self


def check_generated_count(cfg: TrainingData, stage: str) -> None:
    """`data.generate` asks for enough sequences for num_samples and the held-out eval_samples."""
    n = cfg.generate.num_sequences
    if n < (cfg.num_samples or 1) + cfg.eval_samples:
        _too_few_generated(cfg, n, stage)


def _too_few_generated(cfg: TrainingData, n: int, stage: str) -> None:
    need = f"{cfg.num_samples + cfg.eval_samples if cfg.num_samples else cfg.eval_samples + 1} needed (eval_samples {cfg.eval_samples} held out)"
    lower = "data.num_samples or data.eval_samples" if cfg.num_samples else "data.eval_samples"
    raise CompressError(f"stage {stage}: {n} sequences generated by the teacher, {need}",
                        f"generate more (data.generate.num_sequences), or lower {lower}")


def training_sequences(cfg: TrainingData, tokenizer, calibration=None, teacher=None, teacher_hash: str | None = None,
                       seed: int = 0, stage: str = "train", progress=lambda *_: None,
                       encoder: bool = False) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(train [n, seq_len], held-out [eval_samples, seq_len], source description). For an
    `encoder` (BERT), each window of a text is framed by the tokenizer's special tokens ([CLS] ...
    [SEP]), as every input it will embed is (text_windows; calibration windows are built so too)."""
    want = None if cfg.num_samples is None else cfg.num_samples + cfg.eval_samples
    if cfg.generate is not None:
        if teacher is None:
            raise CompressError(f"stage {stage}: data.generate needs a teacher", "set the stage's teacher")
        check_generated_count(cfg, stage)  # before the teacher spends minutes generating too few
        ids = generated_sequences(teacher, tokenizer, cfg.generate, cfg.seq_len, teacher_hash, seed, progress)
        greedy = f", greedy for the {cfg.generate.greedy_tokens} tokens after the first" if cfg.generate.greedy_tokens else ""
        source = (f"{len(ids)} sequences generated by the teacher (top-k {cfg.generate.top_k}, "
                  f"temperature {cfg.generate.temperature:g}{greedy}, seed {seed})")
    elif cfg.dataset is not None:
        specs = [cfg.dataset] if isinstance(cfg.dataset, str) else list(cfg.dataset)
        try:
            text = "\n\n".join(t for spec in specs for t in read_texts(spec, cfg.text_field, cfg.split, cfg.config_name,
                                                                      tokenizer=tokenizer) if t.strip())
        except CompressError as exc:  # the key to set is this stage's, not the calibration section's
            if exc.hint == TEXT_FIELD_HINT:
                raise CompressError(exc.message, f"the field holding the text: the {stage} stage's data.text_field "
                                                 "in a recipe") from None
            raise
        if not text.strip():
            raise CompressError(f"stage {stage}: training data {', '.join(specs)} is empty", "give a file with text in it")
        ids = text_windows(tokenizer, text, cfg.seq_len, want if not cfg.shuffle else None, encoder, f"stage {stage}: data.seq_len")
        if cfg.shuffle and want and want <= len(ids):
            # a seeded choice, kept in text order; the held-out windows are the last of them
            pick = torch.randperm(len(ids), generator=seeded_generator(seed))[:want].sort().values
            ids = ids[pick]
        source = ", ".join(specs) + (f" ({want} windows at random)" if cfg.shuffle and want else "")
    else:
        if calibration is None:
            raise CompressError(f"stage {stage}: no training data", "set data.dataset, data.generate, or a calibration section")
        lengths = {int(s["input_ids"].shape[-1]) for s in calibration.samples}
        if len(lengths) != 1 or any("attention_mask" in s for s in calibration.samples):
            raise CompressError(f"stage {stage}: the calibration set is not packed into windows of one length",
                                "set data.dataset for training, or calibration packing: true")
        ids = torch.cat([s["input_ids"] for s in calibration.samples])
        source = f"calibration set ({calibration.source})"
    want = want or len(ids)
    if len(ids) < want or len(ids) <= cfg.eval_samples:
        need = f"{want if cfg.num_samples else cfg.eval_samples + 1} needed (eval_samples {cfg.eval_samples} held out)"
        if cfg.generate is not None:
            _too_few_generated(cfg, len(ids), stage)
        raise CompressError(f"stage {stage}: training data {source} gives {len(ids)} sequences of {ids.shape[-1]} tokens, {need}",
                            "give more text, or lower data.num_samples, data.eval_samples or data.seq_len")
    ids = ids[:want]
    return ids[: want - cfg.eval_samples], ids[want - cfg.eval_samples:], source


def _cache_root(cfg: GenerateConfig) -> Path:
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    base = os.environ.get("COMPRESS_CACHE") or Path.home() / ".cache" / "compress"
    return Path(base) / "generated"


def end_of_sequence_ids(model, tokenizer) -> set[int]:
    """The tokens that end a text: the tokenizer's EOS and the model's generation_config's (a
    chat model may list several, such as an end-of-turn token)."""
    ends = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config_ends = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if config_ends is not None:
        ends |= set(config_ends) if isinstance(config_ends, (list, tuple)) else {config_ends}
    return {int(t) for t in ends}


def _random_start(starts: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """[1]: a token drawn uniformly from the non-special vocabulary."""
    return starts[torch.randint(len(starts), (1,), generator=generator)]


@torch.no_grad()
def generated_sequences(teacher, tokenizer, cfg: GenerateConfig, seq_len: int, teacher_hash: str | None, seed: int,
                        progress=lambda *_: None) -> torch.Tensor:
    """[num_sequences, seq_len] token ids sampled from `teacher`, read from the cache when there.
    Sequence j draws its first token and every sample from its own generator (seed, j), so which
    sequences come out does not depend on how many are generated at once (`batch_size`) beyond
    the float rounding of batched matrix products; the cache key has the batch size for that rest."""
    key = hashlib.sha256(json.dumps({"teacher": teacher_hash, "seq_len": seq_len, "seed": seed, "sampling": "per-sequence",
                                     "after_end": "random start",
                                     **cfg.model_dump(exclude={"cache_dir"})}, sort_keys=True).encode()).hexdigest()[:20]
    path = _cache_root(cfg) / f"{key}.pt"
    if teacher_hash is not None:  # a cache that cannot be written is said before minutes of generating
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CompressError(f"data.generate.cache_dir {path.parent}: cannot keep generated sequences there "
                                f"({exc.strerror or exc})", "give a directory you can write, or leave cache_dir out") from None
    if teacher_hash is not None and path.is_file():
        try:
            ids = torch.load(path, weights_only=True)
            if ids.shape == (cfg.num_sequences, seq_len):
                return ids
        except Exception:  # a damaged cache entry is regenerated, not trusted
            pass
    special = set(tokenizer.all_special_ids or [])
    starts = torch.tensor([t for t in range(len(tokenizer)) if t not in special])
    ends = end_of_sequence_ids(teacher, tokenizer)
    device = next(teacher.parameters()).device
    was_training = teacher.training
    teacher.eval()
    # transformers 5.24 renamed the cache argument and output `cache`; earlier releases call it past_key_values
    cache_key = "cache" if "cache" in inspect.signature(teacher.forward).parameters else "past_key_values"
    chunks = []
    for i in range(0, cfg.num_sequences, cfg.batch_size):
        n = min(cfg.batch_size, cfg.num_sequences - i)
        progress("generating training data with the teacher", i, cfg.num_sequences)
        gens = [seeded_generator(seed * 1_000_003 + j) for j in range(i, i + n)]
        ids = torch.stack([_random_start(starts, g) for g in gens]).to(device)
        since_start = [1] * n  # tokens since each row's (last) random start, that one included
        past = None
        step_ids = ids
        for _ in range(seq_len - 1):
            out = teacher(input_ids=step_ids, use_cache=True, **{cache_key: past})
            past = getattr(out, cache_key)
            logits = out.logits[:, -1].float() / cfg.temperature
            greedy = logits.argmax(-1).cpu()
            top, idx = logits.topk(min(cfg.top_k, logits.shape[-1]), dim=-1)
            probs, idx = top.softmax(-1).cpu(), idx.cpu()
            chosen = []
            for r, g in enumerate(gens):
                if int(ids[r, -1]) in ends:  # the teacher ended its text: a new one (module docstring)
                    chosen.append(_random_start(starts, g)[0])
                    since_start[r] = 0
                elif since_start[r] <= cfg.greedy_tokens:  # a confident start from a random first token, then variety
                    chosen.append(greedy[r])
                else:
                    chosen.append(idx[r, torch.multinomial(probs[r], 1, generator=g)[0]])
                since_start[r] += 1
            step_ids = torch.stack(chosen).unsqueeze(-1).to(device)
            ids = torch.cat([ids, step_ids], dim=1)
        chunks.append(ids.cpu())
    teacher.train(was_training)
    progress("generating training data with the teacher", cfg.num_sequences, cfg.num_sequences)
    ids = torch.cat(chunks)
    if teacher_hash is not None:
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        try:
            torch.save(ids, tmp)
            os.replace(tmp, path)  # readers never see a half-written file
        except OSError:  # a full or read-only cache costs the next run a regeneration, not this run its data
            tmp.unlink(missing_ok=True)
    return ids

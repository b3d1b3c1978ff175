"""Knowledge distillation: train the model (the student) to match a teacher's outputs.

    - distill:
        teacher: null            # default: the recipe's input model, as it was before any stage
        temperature: 2.0
        divergence: forward      # forward KL (Hinton), reverse KL, or jsd
        ce_weight: 0.0           # λ of the hard-label loss on the training text
        hidden: [{student: -1, teacher: -1}]   # optional hidden-state matching
        data: {dataset: calibration/default.txt, seq_len: 256, num_samples: 1024}
        train: {steps: 300, lr: 1.0e-4, batch_size: 8}

The student is the model as the earlier stages left it: a pruned copy of the teacher (prune,
then distill to recover), or, with `keep_layers`, a shallower copy made of chosen teacher
blocks. Pruned weights stay exactly zero through training (their gradient is masked and the
mask re-applied after every step). The losses are in compress/kd.py, the loop in
compress/training.py; this file wires model, teacher, data and loop together.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from compress import kd, modeling
from compress.engine import on_device
from compress.sparsity import pruned_zeros
from compress.errors import CompressError
from compress.stages.base import Stage, StageContext, from_input
from compress.targets import LINEAR_TYPES, Pattern, matches
from compress.launcher import process_count
from compress.training import StartingValues, TrainingConfig, in_float32, run_fingerprint, train
from compress.training_data import TrainingData, check_generated_count, training_sequences


class HiddenPair(BaseModel):
    """Match the student's hidden states after block `student` to the teacher's after block `teacher`.

    Indices into the models' `hidden_states` outputs: 0 is the embeddings, i the output of block i,
    except the last (the block count, or -1), which is after the model's final norm where it has
    one (Llama's): pair a last index with a last index."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    student: int = Field(..., description="the student's hidden_states index")
    teacher: int = Field(..., description="the teacher's hidden_states index")
    weight: float = Field(1.0, ge=0, description="this pair's weight in the hidden-state loss")


class DistillLoss(BaseModel):
    """The loss keys, shared by `distill` and `qat` (which distills from the full-precision model)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    teacher: Optional[str] = Field(None, description="hub id or directory of the teacher; default: the recipe's input model")
    temperature: float = Field(1.0, gt=0, description="softens both distributions; the soft loss is scaled by T²")
    divergence: Literal["forward", "reverse", "jsd"] = Field(
        "forward", description="KL(teacher ‖ student) (Hinton), KL(student ‖ teacher), or Jensen-Shannon")
    kd_weight: float = Field(1.0, ge=0, description="weight of the logit distillation loss (0: none)")
    ce_weight: float = Field(0.0, ge=0, description="λ: weight of the next-token cross-entropy on the training text")
    hidden: list[HiddenPair] = Field(default_factory=list, description="hidden-state pairs to match")
    hidden_loss: Literal["auto", "mse", "cosine"] = Field(
        "auto", description="auto: cosine for an encoder (a few of BERT's hidden dimensions are far larger than the "
                            "rest, and mse fits them at the cost of the direction embeddings are compared by), mse for a causal LM")


class DistillationObjective(torch.nn.Module):
    """forward(input_ids) -> (loss, {name: float}), what compress.training.train optimizes.

    Student (trained), projection heads (trained), teacher (frozen, not a submodule, so never
    saved, wrapped by DDP or handed to the optimizer)."""

    def __init__(self, student: torch.nn.Module, teacher: Optional[torch.nn.Module], loss: DistillLoss, causal: bool):
        super().__init__()
        self.student = student
        self._teacher = (teacher,)
        self.loss = loss
        self.causal = causal
        self.projections = torch.nn.ModuleList()
        for pair in loss.hidden:
            s_width, t_width = _width(student), _width(teacher)
            # A learned projection only where widths differ; identity otherwise, so that matching
            # a pruned copy of the teacher starts from an exact correspondence.
            self.projections.append(torch.nn.Linear(s_width, t_width, bias=False) if s_width != t_width
                                    else torch.nn.Identity())

    @property
    def teacher(self) -> Optional[torch.nn.Module]:
        return self._teacher[0]

    def _forward(self, model: torch.nn.Module, input_ids: torch.Tensor):
        kwargs = {"use_cache": False} if self.causal else {}
        return model(input_ids=input_ids, output_hidden_states=bool(self.loss.hidden), **kwargs)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
        loss = self.loss
        out = self._forward(self.student, input_ids)
        parts: dict[str, float] = {}
        total = torch.zeros((), device=input_ids.device)
        t_out = None
        if self.teacher is not None and (loss.kd_weight > 0 or loss.hidden):
            with torch.no_grad():
                t_out = self._forward(self.teacher, input_ids)
        if self.causal:
            ce = kd.next_token_loss(out.logits, input_ids)
            parts["ce"] = float(ce.detach())
            if loss.ce_weight > 0:
                total = total + loss.ce_weight * ce
            if t_out is not None and loss.kd_weight > 0:
                soft = kd.logit_kd_loss(out.logits, t_out.logits, loss.temperature, loss.divergence)
                parts["kd"] = float(soft.detach())
                total = total + loss.kd_weight * soft
        for pair, projection in zip(loss.hidden, self.projections):
            h = kd.hidden_state_loss(projection(out.hidden_states[pair.student]), t_out.hidden_states[pair.teacher],
                                     loss.hidden_loss)
            parts[f"hidden_{pair.student}_{pair.teacher}"] = float(h.detach())
            total = total + pair.weight * h
        parts["loss"] = float(total.detach())
        return total, parts


class Distill(DistillLoss, Stage):
    """Train the current model to match a teacher, keeping pruned weights at zero."""

    keep_layers: Optional[list[int]] = Field(
        None, description="make the student a shallower copy: keep only these blocks (0-based) before training")
    freeze: list[Pattern] = Field(default_factory=list, description="parameters kept fixed: name patterns (suffix, or re:)")
    data: TrainingData = Field(default_factory=TrainingData, description="training sequences")
    train: TrainingConfig = Field(default_factory=TrainingConfig, description="the optimizer and its schedule")
    keep_start_if_worse: bool = Field(True, description="when training ends with a higher held-out KD (or loss) than it "
                                      "started with, give back the starting weights (a copy of them is kept in CPU memory)")

    @property
    def needs_calibration(self) -> bool:
        return self.data.dataset is None and self.data.generate is None  # trains on the calibration windows

    @property
    def reshapes(self) -> bool:
        return self.keep_layers is not None

    def preflight_shapes(self, model: torch.nn.Module, records: dict[str, dict], source: torch.nn.Module) -> None:
        # the input's directory, where its config may say it is quantized (another tool's checkpoint)
        refuse_quantized_student(records, getattr(source.config, "_name_or_path", None) or None)
        if self.keep_layers is not None:
            check_keep_layers(model, self.keep_layers, "distill")
        depth = len(self.keep_layers) if self.keep_layers is not None else int(model.config.num_hidden_layers)
        check_training(self, "distill", model, depth, source.config)

    def reshape(self, model: torch.nn.Module, records: dict[str, dict]) -> bool:
        keep_blocks(model, self.keep_layers, records, "distill")
        return True  # the blocks kept are named

    def apply(self, model: torch.nn.Module, ctx: StageContext) -> dict:
        refuse_quantized_student(ctx.layers, ctx.source_model)
        if self.keep_layers is not None:
            keep_blocks(model, self.keep_layers, ctx.layers, "distill")
        teacher, teacher_ref = load_teacher(self.teacher, model, ctx, "distill")
        trainable = trainable_parameters(model, self.freeze, "distill")
        summary = run_training(self, "distill", model, teacher, teacher_ref, ctx, self.data, self.train, trainable=trainable)
        return summary


def keep_start_if_worse(summary: dict, start: Optional[StartingValues], stage: str, index: int, starting: str) -> None:
    """A run too short (or an lr too high) can end worse than it started: the start is given back
    (`start`; None: keep_start_if_worse: false, the worse model is kept), and either is said.
    Worse is judged on the held-out KD where there is a teacher (the fidelity the stage is for),
    else the held-out loss, beyond the float noise of a loss that did not move. Given back, the
    summary's `held_out_*_after` figures are the saved model's (the start's), and the run that was
    turned down keeps its own as `held_out_*_trained`."""
    for label in ("held_out_kd", "held_out_loss"):
        before, after = summary.get(f"{label}_before"), summary.get(f"{label}_after")
        if before is None or after is None:
            continue
        if after > before * (1 + 1e-4) + 1e-9:
            what = f"the held-out {label.removeprefix('held_out_')} is {after:.4g} after training, {before:.4g} before"
            if start is not None:
                start.restore()
                summary["kept_start"] = f"{what}: {starting} are kept (keep_start_if_worse)"
                for figure in ("held_out_kd", "held_out_ppl", "held_out_loss"):
                    if summary.get(f"{figure}_before") is not None and f"{figure}_after" in summary:
                        summary[f"{figure}_trained"] = summary[f"{figure}_after"]
                        summary[f"{figure}_after"] = summary[f"{figure}_before"]
            kept = f"{starting} are kept" if start is not None else "the model got worse"
            summary["warnings"] = [f"stage {index + 1} ({stage}): {what}: {kept}; train longer or with a lower lr"]
        return


def refuse_quantized_student(layers: dict[str, dict], source_model: Optional[str] = None) -> None:
    """Distillation trains float weights: a quantized student would come out dense, its grid lost
    (and its rounded zeros mistaken for a pruning mask). QAT is the stage that trains through a grid.
    `layers`: what earlier stages did (StageContext.layers) or will do (before the first stage)."""
    quantized = [n for n, r in layers.items() if r.get("weights") and not from_input(r)]
    where = "an earlier stage quantized" if quantized else None
    if not where and input_is_quantized(layers, source_model):
        where = "the input model" + (f" {source_model}" if source_model else "") + " is quantized"
    if where:
        raise CompressError(f"stage distill: {where}" + (f" ({len(quantized)} layers)" if quantized else "")
                            + "; distillation trains float weights and would save a dense model",
                            "use a qat stage (it distills from the float model through the quantization grid), "
                            "or distill before quantizing")


def input_is_quantized(layers: dict[str, dict], source_model: Optional[str]) -> bool:
    """Whether the recipe's input model is quantized: a compress output says so in its
    compress.json (the records it came with, even saved dense), another tool's checkpoint in the
    quantization_config of its config.json."""
    source = Path(modeling.resolve_model(source_model)) if source_model else None
    config = source / "config.json" if source is not None else None
    packed = config is not None and config.is_file() and json.loads(config.read_text()).get("quantization_config")
    return bool(packed) or any(r.get("weights") and from_input(r) for r in layers.values())


# -- shared with the qat stage --------------------------------------------------------------------

def load_teacher(ref: Optional[str], student: torch.nn.Module, ctx: StageContext, stage: str):
    """The teacher in float32 on the device: `ref`, or the recipe's input model."""
    ref = ref or ctx.source_model
    if ref is None:
        raise CompressError(f"stage {stage}: no teacher", "set the stage's teacher: a hub id or model directory")
    teacher, teacher_tokenizer, config = modeling.load_model(ref, dtype="float32", device=ctx.device)
    check_vocabularies(stage, ref, config, student.config)
    check_tokenizers(stage, ref, teacher_tokenizer, ctx.source_model, ctx.tokenizer)
    teacher.requires_grad_(False)
    return teacher, ref


def check_tokenizers(stage: str, teacher_ref: str, teacher_tokenizer, student_ref: Optional[str], student_tokenizer) -> None:
    """One vocabulary size is not one tokenizer (Llama 2 and Mistral both have 32,000 tokens): a
    teacher that maps text to other ids would read the student's ids as other words, and its
    targets would teach nonsense. `compress eval` refuses such a pair too."""
    if teacher_tokenizer is not None and student_tokenizer is not None and teacher_tokenizer.get_vocab() != student_tokenizer.get_vocab():
        raise CompressError(f"stage {stage}: teacher {teacher_ref} has a tokenizer that maps text to different ids from the "
                            f"student's ({student_ref or 'the input model'})", "distill between models that share a tokenizer")


def check_vocabularies(stage: str, teacher_ref: str, teacher_config, student_config) -> None:
    teacher_vocab, student_vocab = getattr(teacher_config, "vocab_size", None), getattr(student_config, "vocab_size", None)
    if teacher_vocab != student_vocab:
        raise CompressError(f"stage {stage}: teacher {teacher_ref} has vocabulary size {teacher_vocab}, the student {student_vocab}",
                            "distill between models that share a tokenizer")


def frozen_parameters(model: torch.nn.Module, freeze: list[str], stage: str) -> dict[str, bool]:
    """Whether each parameter is matched by a `freeze` pattern (its name, or its module's);
    refuses patterns that match none, and freezing everything."""
    frozen, used = {}, set()
    for name, param in model.named_parameters():
        # a weight QAT reparametrizes (…q_proj.parametrizations.weight.original) is matched by its
        # own name, as the patterns were checked before the stage started and as plan shows it
        plain = re.sub(r"\.parametrizations\.(\w+)\.original$", r".\1", name)
        module_name = plain.rsplit(".", 1)[0]
        hit = [p for p in freeze if matches(p, plain, param) or matches(p, module_name, param)]
        used.update(hit)
        frozen[name] = bool(hit)
    unused = [p for p in freeze if p not in used]
    if unused:
        raise CompressError(f"stage {stage}: freeze patterns {unused} match no parameter",
                            "use parameter or module names as `compress plan` shows them, e.g. embed_tokens")
    if all(frozen.values()):
        raise CompressError(f"stage {stage}: every parameter is frozen", "freeze fewer parameters")
    return frozen


def trainable_parameters(model: torch.nn.Module, freeze: list[str], stage: str) -> list[torch.nn.Parameter]:
    """Every parameter not matched by a `freeze` pattern; only the matched ones stop requiring
    gradients, so what an earlier training stage froze trains again here unless frozen anew."""
    frozen = frozen_parameters(model, freeze, stage)
    for name, param in model.named_parameters():
        param.requires_grad_(not frozen[name])
    return [param for name, param in model.named_parameters() if not frozen[name]]


def check_loss(stage: str, loss: "DistillLoss", causal: bool, student_layers: int, teacher_layers: Optional[int]) -> None:
    """What the objective needs of the student and the teacher (None: no teacher)."""
    if not causal and loss.hidden and not any(pair.weight > 0 for pair in loss.hidden):
        raise CompressError(f"stage {stage}: every hidden pair weighs 0 (kd_weight acts on logits, which an encoder has "
                            "none of): the loss is zero, nothing to train on", "give a hidden pair a weight above 0")
    if loss.kd_weight == 0 and loss.ce_weight == 0 and not any(pair.weight > 0 for pair in loss.hidden):
        raise CompressError(f"stage {stage}: kd_weight and ce_weight are both 0" + (" and every hidden pair weighs 0" if loss.hidden else "")
                            + ": the loss is zero, nothing to train on",
                            "set kd_weight (distill from the teacher), ce_weight (the text itself) or hidden")
    if not causal and not loss.hidden:
        raise CompressError(f"stage {stage}: the model has no language-model logits to distill (an encoder)",
                            "match hidden states instead: hidden: [{student: -1, teacher: -1}] in a recipe, --hidden=-1:-1 on compress distill")
    if not causal and loss.ce_weight:
        raise CompressError(f"stage {stage}: ce_weight needs a causal language model", "set ce_weight: 0")
    if loss.hidden and teacher_layers is None:
        raise CompressError(f"stage {stage}: hidden-state matching needs a teacher", "set kd_weight > 0 or a teacher")
    for pair in loss.hidden:
        for side, layers, index in (("student", student_layers, pair.student), ("teacher", teacher_layers, pair.teacher)):
            states = layers + 1  # the embeddings, then one per block
            if not -states <= index < states:
                raise CompressError(f"stage {stage}: hidden {side} index {index} is out of range: the {side} has "
                                    f"hidden states 0..{states - 1} (0: embeddings, i: after block i; the last, also -1: after the final norm)",
                                    f"give a {side} index from {-states} to {states - 1}")


def uses_teacher(stage: "DistillLoss", name: str) -> bool:
    return name == "distill" or stage.kd_weight > 0 or bool(stage.hidden)


def check_training(stage, name: str, model: torch.nn.Module, student_layers: int, source_config) -> None:
    """A training stage's checks on the model it will get, made before any stage runs: the loss
    (check_loss; the teacher's depth from its config: `teacher`, or the input model's,
    `source_config`), and the freeze patterns (on the names before any keep_layers cut, of which
    the names after it are a subset: a pattern refused here is refused then too)."""
    teacher_config = None
    if uses_teacher(stage, name):
        teacher_config = modeling.load_config(stage.teacher) if stage.teacher else source_config
    teacher_layers = int(teacher_config.num_hidden_layers) if teacher_config is not None else None
    # the vocabularies first: with another tokenizer no loss (logits or hidden states) is meaningful
    if teacher_config is not None:
        check_vocabularies(name, stage.teacher or "the input model", teacher_config, model.config)
    student_ref = getattr(source_config, "_name_or_path", None) or None
    if stage.teacher and student_ref and uses_teacher(stage, name):  # before any stage's work, not when this one starts
        check_tokenizers(name, stage.teacher, modeling.load_tokenizer(stage.teacher), student_ref, modeling.load_tokenizer(student_ref))
    causal = modeling.is_causal_lm(model.config)
    check_loss(name, stage, causal, student_layers, teacher_layers)
    frozen_parameters(model, stage.freeze, name)
    processes = process_count()  # under a launcher: each step's batch and the held-out set are split over them
    if stage.train.batch_size % processes:
        raise CompressError(f"stage {name}: batch_size {stage.train.batch_size} does not split over {processes} processes",
                            f"use a multiple of {processes}")
    if stage.data.eval_samples < processes:  # a process with no held-out sequence would wait for the others for ever
        raise CompressError(f"stage {name}: eval_samples {stage.data.eval_samples} is fewer than the {processes} processes "
                            "the held-out sequences are split over", f"hold out at least {processes}")
    if stage.data.generate is not None and not causal:
        raise CompressError(f"stage {name}: data.generate samples text from a causal language model's next-token "
                            f"distribution; {type(model).__name__} is an encoder", "train on text instead: set data.dataset")
    if stage.data.generate is not None:
        check_generated_count(stage.data, name)


def pruning_masks(model: torch.nn.Module, ctx: StageContext) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(weight, mask) for every linear layer an earlier stage pruned, or, where no stage recorded the
    layer, in which at least 10 % of the weights are exactly zero (zeros_are_a_mask): training keeps
    them zero. A layer quantized and never pruned has no mask: its zeros are rounded codes."""
    masks = []
    for name, module in model.named_modules():
        if type(module).__name__ not in LINEAR_TYPES:
            continue
        w = module.weight
        zero = pruned_zeros(w, record=ctx.layers.get(name))
        if zero is not None:
            masks.append((w, (~zero).to(w.dtype)))
    return masks


def check_keep_layers(model: torch.nn.Module, keep: list[int], stage: str) -> None:
    from compress.engine import find_blocks

    blocks = find_blocks(model)[1]
    bad = [i for i in keep if not 0 <= i < len(blocks)]
    if bad or not keep or len(set(keep)) != len(keep):
        raise CompressError(f"stage {stage}: keep_layers {keep} is not a list of distinct blocks of the model's {len(blocks)}",
                            f"choose indices from 0 to {len(blocks) - 1}")


def keep_blocks(model: torch.nn.Module, keep: list[int], records: dict[str, dict], stage: str) -> None:
    """Make `model` a shallower copy of itself from the blocks in `keep` (in that order); `records`
    (per layer, as StageContext.layers) follow their blocks."""
    from compress.engine import find_blocks
    from compress.stages.structured import Structured, per_layer_config

    check_keep_layers(model, keep, stage)
    path, blocks = find_blocks(model)
    changes = {"num_hidden_layers": len(keep), **per_layer_config(model.config, list(keep))}
    Structured._remove_blocks(model, path, blocks, list(keep), records)
    for key, value in changes.items():
        setattr(model.config, key, value)


def run_training(stage: BaseModel, name: str, model: torch.nn.Module, teacher: Optional[torch.nn.Module],
                 teacher_ref: Optional[str], ctx: StageContext, data: TrainingData, cfg: TrainingConfig,
                 trainable: list[torch.nn.Parameter], extra_groups: list[dict] = (), masks: Optional[list] = None,
                 settle: Callable[[], None] = lambda: None, starting: str = "the starting weights",
                 begin: Callable[[], None] = lambda: None) -> dict:
    """Data, objective, loop, and the summary both training stages report. `begin`: the stage's
    own step once the trained tensors are float32, before the first step (QAT's tie breaking).
    `settle`: the stage's own step from trained float32 values to saved ones (QAT's grid), before
    they are rounded to the model's dtype and the final held-out figures measured. With the stage's
    keep_start_if_worse, a CPU copy of every trained parameter (`extra_groups`' too) is kept, and
    a run that ends worse gives them back; `starting` names them in the warning."""
    start = StartingValues([*trainable, *(p for g in extra_groups for p in g["params"])]) if stage.keep_start_if_worse else None
    causal = modeling.is_causal_lm(model.config)
    loss_cfg = DistillLoss(**{k: getattr(stage, k) for k in DistillLoss.model_fields})
    if loss_cfg.hidden_loss == "auto":
        loss_cfg = loss_cfg.model_copy(update={"hidden_loss": "mse" if causal else "cosine"})
    check_loss(name, loss_cfg, causal, int(model.config.num_hidden_layers),
               int(teacher.config.num_hidden_layers) if teacher is not None else None)
    teacher_hash = modeling.weights_hash(teacher_ref) if teacher_ref else None
    train_ids, eval_ids, source = training_sequences(data, ctx.tokenizer, ctx.calibration, teacher, teacher_hash,
                                                     ctx.seed, name, ctx.progress, encoder=not causal)
    # back in the CPU memory it had (unfused experts stay views), and in its dtype, trained in float32
    with on_device(model, ctx.device), in_float32(model) as as_stored:
        objective = DistillationObjective(model, teacher, loss_cfg, causal)
        masks = pruning_masks(model, ctx) if masks is None else masks
        groups = [{"params": trainable, "lr": cfg.lr}]
        if len(objective.projections) and any(p.requires_grad for p in objective.projections.parameters()):
            groups.append({"params": list(objective.projections.parameters()), "lr": cfg.lr})
        groups += list(extra_groups)
        # the trained parameters' names too: a checkpoint laid out otherwise (QAT's step sizes became
        # log_scale) is another run's, refused cleanly rather than failing to load
        layout = [n for n, p in objective.named_parameters() if p.requires_grad]
        fingerprint = run_fingerprint(name, stage.model_dump(mode="json"), ctx.source_hash, teacher_hash,
                                      train_ids.shape, float(train_ids.float().sum()), ctx.seed, ctx.stage_index, layout)
        checkpoint_dir = ctx.work_dir / f"{ctx.stage_index}-{name}" if ctx.work_dir is not None else None
        begin()
        result = train(objective, train_ids, eval_ids, cfg, param_groups=groups, device=ctx.device, seed=ctx.seed,
                       masks=masks, checkpoint_dir=checkpoint_dir, resume=ctx.resume, fingerprint=fingerprint,
                       progress=ctx.progress, name=name, stop_after=ctx.stop_after_steps,
                       settle=lambda: (settle(), as_stored()))
    model.eval()
    if teacher is not None:
        teacher.to("cpu")
    masked_zero = all(bool((p[m.to(p.device) == 0] == 0).all()) for p, m in masks)
    before, after = result["eval_before"], result["eval_after"]
    summary = {
        "scheme": f"{name} from {teacher_ref or 'no teacher (task loss)'}",
        "teacher": teacher_ref,
        "data": source,
        "steps": result["steps"],
        "train_samples": result["train_samples"],
        "tokens_per_step": result["tokens_per_step"],
        "trainable_parameters": sum(p.numel() for p in trainable),
        "masked_layers": len(masks),
        "masks_kept": masked_zero,
    }
    for key, label in (("eval_kd", "held_out_kd"), ("eval_perplexity", "held_out_ppl"), ("eval_loss", "held_out_loss")):
        if key in after:
            summary[f"{label}_before"], summary[f"{label}_after"] = before.get(key), after[key]
    if result["resumed_from_step"]:
        summary["resumed_from_step"] = result["resumed_from_step"]
    summary["training"] = {"loss": loss_cfg.model_dump(exclude={"teacher"}), "train": cfg.model_dump(), **result}
    keep_start_if_worse(summary, start, name, ctx.stage_index, starting)
    return summary


def _width(model: Optional[torch.nn.Module]) -> int:
    return int(model.config.hidden_size) if model is not None else 0

"""The training loop shared by distillation and quantization-aware training.

    for step in 1..steps:
        for each of `gradient_accumulation` micro-batches:   forward the objective, backward
        mask gradients of pruned weights; clip; AdamW step; re-apply masks
        learning rate: linear warm-up, then cosine (or linear, or constant) decay to min_lr
        every eval_every steps: held-out loss (and perplexity); every save_every: a checkpoint

It runs through `accelerate`, so the same code runs on the CPU, on one GPU with bf16/fp16
autocast, and across processes with `accelerate launch` (DDP; FSDP through accelerate's config).
What it trains is an objective: a module whose forward takes a batch of token ids and returns
(loss, {name: float}), so that DDP sees every trained parameter (student and projection heads) in one forward.

Exact resume: the order of samples is a function of (seed, step), not of a data loader's hidden
state, and a checkpoint (accelerate's save_state: weights, optimizer moments, RNG states) holds
the step it was written at; resuming from step n replays steps n+1.. exactly as an uninterrupted
run would, bit for bit on the CPU (tested).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from compress.errors import CompressError
from compress.launcher import process_count
from compress.moe import fused_layout
from compress.seeding import seeded_generator

Progress = Callable[[str, int, int], None]


class TrainingConfig(BaseModel):
    """A training stage's `train:` keys."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    steps: int = Field(200, gt=0, description="optimizer steps")
    batch_size: int = Field(8, gt=0, description="sequences per micro-batch, over all processes")
    gradient_accumulation: int = Field(1, gt=0, description="micro-batches per optimizer step")
    lr: float = Field(1e-4, gt=0, description="peak learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    warmup: float = Field(0.05, ge=0, description="warm-up: a share of the steps if below 1, else a number of steps")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="learning-rate decay after the warm-up")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the decay ends at lr · min_lr_ratio")
    max_grad_norm: Optional[float] = Field(1.0, gt=0, description="clip the gradient's global norm; null: no clipping")
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field(
        "auto", description="autocast on GPU; auto: bf16 where the GPU supports it, else none; always none on CPU")
    eval_every: int = Field(50, ge=0, description="held-out evaluation every N steps (0: only before and after)")
    save_every: int = Field(50, ge=0, description="a resumable checkpoint every N steps (0: none)")

    @model_validator(mode="after")
    def _warmup_fits(self) -> "TrainingConfig":
        if self.warmup_steps() > self.steps:  # the learning rate would never reach lr, nor decay
            raise ValueError(f"a warm-up of {self.warmup_steps()} steps is longer than the run's {self.steps}: "
                             "lower warmup (or give a share of the steps below 1)")
        return self

    def warmup_steps(self) -> int:
        return int(self.warmup * self.steps) if self.warmup < 1 else int(self.warmup)

    def lr_factor(self, step: int) -> float:
        """Multiplier of the peak learning rate for optimizer step `step` (1-based)."""
        warm = self.warmup_steps()
        if step <= warm:
            return step / max(warm, 1)
        if self.schedule == "constant":
            return 1.0
        progress = (step - warm) / max(self.steps - warm, 1)
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if self.schedule == "cosine" else 1 - progress
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * decay


@dataclass
class TrainState:
    """The loop's own state that a checkpoint must restore besides weights, optimizer and RNG."""

    step: int = 0
    history: list = field(default_factory=list)
    # training losses summed since the last history point, and over how many steps: a run resumed
    # between two points averages the steps before the stop too
    interval: dict = field(default_factory=dict)
    interval_steps: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "history": json.dumps(self.history), "interval": json.dumps(self.interval),
                "interval_steps": self.interval_steps}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.history = json.loads(state["history"])
        self.interval = json.loads(state.get("interval", "{}"))
        self.interval_steps = int(state.get("interval_steps", 0))


class StartingValues:
    """The trained values as they start, copied to the host, to give back when training ends
    worse than it started: one more copy of the trained parameters in CPU memory."""

    def __init__(self, params: list[torch.Tensor]):
        self._saved = [(p, p.detach().to("cpu", copy=True)) for p in params]

    @torch.no_grad()
    def restore(self) -> None:
        for param, value in self._saved:
            param.copy_(value)


def sample_order(step: int, micro: int, cfg: TrainingConfig, n_samples: int, seed: int) -> torch.Tensor:
    """Indices of the samples in micro-batch `micro` of optimizer step `step` (1-based): epochs of
    a seeded permutation, consumed in order. A pure function of its arguments, which is what makes
    resuming exact."""
    start = ((step - 1) * cfg.gradient_accumulation + micro) * cfg.batch_size
    positions = torch.arange(start, start + cfg.batch_size)
    epochs, within = positions // n_samples, positions % n_samples
    out = torch.empty_like(positions)
    for epoch in epochs.unique().tolist():
        perm = torch.randperm(n_samples, generator=seeded_generator(seed * 100003 + epoch))
        sel = epochs == epoch
        out[sel] = perm[within[sel]]
    return out


@contextmanager
def in_float32(model: torch.nn.Module):
    """Train in float32 whatever the model's dtype, each tensor back in its own dtype after.
    AdamW on float16 weights breaks at once (eps and g² underflow to 0: one step turns weights
    into inf and NaN), and bfloat16 weights drop every update below their 8-bit mantissa; on the
    GPU, `mixed_precision` autocasts the computation over these float32 weights.

    Yields `as_stored()`: round every such tensor to the values its dtype holds (staying float32),
    so that what is measured after training is the model that will be saved, not a float32 one
    that no checkpoint holds."""
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point() and t.dtype != torch.float32]
    dtypes = [t.dtype for t in tensors]
    for t in tensors:
        t.data = t.data.float()

    def as_stored() -> None:
        with torch.no_grad():
            for t, dtype in zip(tensors, dtypes):
                t.copy_(t.to(dtype))

    try:
        yield as_stored
    finally:
        for t, dtype in zip(tensors, dtypes):
            t.data = t.data.to(dtype)


def make_accelerator(cfg: TrainingConfig, device: torch.device):
    """An Accelerator for `device` (CPU, or the GPU of this process under `accelerate launch`)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    if process_count() == 1:
        # accelerate keeps one process-wide state and refuses an Accelerator with another device or
        # precision. In a single process every training stage (QAT on the GPU, then a CPU run in the
        # same Python session) may ask for its own, so each starts from a fresh state; under
        # `accelerate launch` the state holds the process group and is kept.
        AcceleratorState._reset_state(reset_partial_state=True)
    precision = cfg.mixed_precision
    if device.type != "cuda":
        precision = "no"  # autocast on the CPU is slower than float32 and no more faithful
    elif precision == "auto":
        precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    # On the CPU accelerate runs several processes as DDP (gloo); it enables FSDP only for GPU-type
    # process groups, so an FSDP launch config on a CPU-only machine trains as DDP (the report's
    # `distributed` says which).
    return Accelerator(cpu=device.type != "cuda", mixed_precision=precision)


def latest_checkpoint(directory: Path) -> Optional[Path]:
    """The newest complete checkpoint in `directory` (one written through to its marker file)."""
    done = [p for p in directory.glob("step-*") if (p / "complete").is_file()] if directory.is_dir() else []
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


def run_fingerprint(*parts) -> str:
    """A hash of what determines a training run, stored with its checkpoints: resuming from a
    checkpoint of a different run would silently mix two runs."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def train(objective: torch.nn.Module, train_ids: torch.Tensor, eval_ids: torch.Tensor, cfg: TrainingConfig, *,
          param_groups: list[dict], device: torch.device, seed: int = 0, masks: list[tuple] = (),
          checkpoint_dir: Optional[Path] = None, resume: bool = False, fingerprint: str = "",
          progress: Progress = lambda *_: None, name: str = "train", stop_after: Optional[int] = None,
          settle: Callable[[], None] = lambda: None) -> dict:
    """Train `objective`'s parameters in `param_groups` (AdamW groups, each with its peak `lr`) on
    `train_ids` [n, seq_len]; returns the history and final held-out figures.

    masks: (parameter, 0/1 tensor) pairs: pruned weights get no gradient and stay exactly zero.
    checkpoint_dir/resume: where checkpoints go, and whether to continue from the newest one.
    stop_after: stop (as if killed) after this many steps; for resume tests.
    settle: called after the last step, before the final held-out evaluation: brings the weights
    to what will be saved (their dtype's values, QAT's grid), so that figure is the saved model's."""
    accelerator = make_accelerator(cfg, device)
    world, rank = accelerator.num_processes, accelerator.process_index
    if cfg.batch_size % world:
        raise CompressError(f"stage {name}: batch_size {cfg.batch_size} does not split over {world} processes",
                            f"use a multiple of {world}")
    if len(train_ids) < 1:
        raise CompressError(f"stage {name}: no training samples", "give more training text, or lower eval_samples")

    for group in param_groups:
        group["peak_lr"] = group["lr"]
    optimizer = torch.optim.AdamW(param_groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    objective, optimizer = accelerator.prepare(objective, optimizer)
    state = TrainState()
    accelerator.register_for_checkpointing(state)

    if checkpoint_dir is not None:
        checkpoint_dir = Path(checkpoint_dir)
        found = latest_checkpoint(checkpoint_dir) if resume else None
        if found is not None:
            written_by = (found / "fingerprint").read_text().strip() if (found / "fingerprint").is_file() else ""
            if written_by != fingerprint:
                raise CompressError(f"stage {name}: the checkpoint in {found} was written by a different run "
                                    f"(model, recipe stage or data changed)",
                                    f"drop --resume to start over, or delete {checkpoint_dir}")
            with fused_layout(objective):  # saved so: see _save
                accelerator.load_state(str(found))
        elif accelerator.is_main_process and checkpoint_dir.exists():
            shutil.rmtree(checkpoint_dir)  # a fresh run does not keep an older run's checkpoints
    resumed_from = state.step
    # The masks were taken from the weights before `prepare` moved them to the device.
    masks = [(param, mask.to(param.device)) for param, mask in masks]

    def masked() -> None:
        with torch.no_grad():
            for param, mask in masks:
                param.mul_(mask)

    def evaluate() -> dict:
        objective.eval()
        totals: dict[str, float] = {}
        with torch.no_grad():
            rows = eval_ids[rank::world]
            for i in range(0, len(rows), cfg.batch_size):
                _, parts = objective(rows[i: i + cfg.batch_size].to(accelerator.device))
                n = len(rows[i: i + cfg.batch_size])
                for k, v in parts.items():
                    totals[k] = totals.get(k, 0.0) + v * n
        count = torch.tensor([float(len(rows))] + list(totals.values()), device=accelerator.device)
        count = accelerator.reduce(count, reduction="sum")
        objective.train()
        means = {k: float(v) / max(float(count[0]), 1) for k, v in zip(totals, count[1:])}
        if "ce" in means:
            means["perplexity"] = math.exp(min(means["ce"], 50))
        return means

    if state.step == 0 and not state.history:
        state.history.append({"step": 0, **{f"eval_{k}": v for k, v in evaluate().items()}})
    objective.train()
    masked()
    mask_of = {id(p): m for p, m in masks}
    n = len(train_ids)
    tokens_per_step = cfg.batch_size * cfg.gradient_accumulation * train_ids.shape[1]
    last: dict = {}
    while state.step < cfg.steps:
        step = state.step + 1
        for group in optimizer.param_groups:
            group["lr"] = group["peak_lr"] * cfg.lr_factor(step)
        sums: dict[str, float] = {}
        for micro in range(cfg.gradient_accumulation):
            batch = train_ids[sample_order(step, micro, cfg, n, seed)][rank::world].to(accelerator.device)
            sync = micro == cfg.gradient_accumulation - 1
            with (accelerator.no_sync(objective) if not sync and world > 1 else nullcontext()):
                loss, parts = objective(batch)
                finite = math.isfinite(float(loss.detach()))
                if world > 1:  # agreed: a process stopping alone would leave the others waiting in backward
                    finite = float(accelerator.reduce(torch.tensor(float(finite), device=accelerator.device),
                                                      reduction="sum")) == world
                if not finite:  # saving what follows would save NaN weights
                    value = float(loss.detach())
                    raise CompressError(f"stage {name}: the training loss is "
                                        f"{value if not math.isfinite(value) else 'not finite (on another process)'} at step {step}",
                                        "lower the learning rate (lr), or clip the gradients harder (a lower max_grad_norm)")
                accelerator.backward(loss / cfg.gradient_accumulation)
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v / cfg.gradient_accumulation
        if world > 1 and sums:  # each process saw its share of the batch: the step's loss is their mean
            sums = dict(zip(sums, accelerator.reduce(torch.tensor(list(sums.values()), device=accelerator.device),
                                                     reduction="mean").tolist()))
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and id(p) in mask_of:
                    p.grad.mul_(mask_of[id(p)])
        grad_norm = None
        if cfg.max_grad_norm is not None:
            grad_norm = float(accelerator.clip_grad_norm_(
                [p for g in optimizer.param_groups for p in g["params"]], cfg.max_grad_norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        masked()
        state.step = step
        last = {"step": step, "lr": optimizer.param_groups[0]["lr"], **{f"train_{k}": v for k, v in sums.items()}}
        if grad_norm is not None:
            last["grad_norm"] = grad_norm
        for k, v in sums.items():
            state.interval[k] = state.interval.get(k, 0.0) + v
        state.interval_steps += 1
        if step == cfg.steps:
            settle()
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
            last.update({f"eval_{k}": v for k, v in evaluate().items()})
            # the curve's training losses: the mean over the steps since the previous point, not
            # the one step that happened to land on it (one batch's loss is noisy)
            state.history.append({**last, **{f"train_{k}": v / state.interval_steps for k, v in state.interval.items()},
                                  "train_steps": state.interval_steps, "tokens_seen": step * tokens_per_step})
            state.interval, state.interval_steps = {}, 0
        shown = " ".join(f"{k} {v:.4g}" for k, v in sums.items())
        if "ce" in sums:
            shown += f" ppl {math.exp(min(sums['ce'], 50)):.2f}"
        progress(f"{name} step {step}/{cfg.steps} {shown}", step, cfg.steps)
        if checkpoint_dir is not None and cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps:
            _save(accelerator, objective, checkpoint_dir, step, fingerprint)
        if stop_after is not None and step - resumed_from >= stop_after and step < cfg.steps:
            raise TrainingStopped(step)

    _wait_for_everyone(accelerator)
    if not all(bool(torch.isfinite(p).all()) for g in optimizer.param_groups for p in g["params"]):
        raise CompressError(f"stage {name}: training left non-finite weights (step {state.step})",
                            "lower the learning rate (lr), or clip gradients (max_grad_norm)")
    final = {k: v for k, v in state.history[-1].items() if k.startswith("eval_")}
    start = {k: v for k, v in state.history[0].items() if k.startswith("eval_")}
    return {"steps": cfg.steps, "resumed_from_step": resumed_from or None, "processes": world,
            "distributed": getattr(accelerator.distributed_type, "value", str(accelerator.distributed_type)),
            "mixed_precision": accelerator.mixed_precision, "train_samples": n, "eval_samples": len(eval_ids),
            "tokens_per_step": tokens_per_step,
            "eval_before": start, "eval_after": final, "last_step": last, "history": state.history}


class TrainingStopped(Exception):
    """Raised by `stop_after`: the run ends as an interrupted one would, its checkpoints kept."""

    def __init__(self, step: int):
        super().__init__(f"stopped after step {step}")
        self.step = step


def _save(accelerator, objective: torch.nn.Module, directory: Path, step: int, fingerprint: str) -> None:
    """accelerate's save_state into step-N, marked complete only once written: a kill during the
    save leaves an incomplete directory that resume ignores. Older checkpoints are then removed.
    Mixture-of-experts weights are saved fused: the unfused experts share the fused parameters'
    memory, and accelerate's safetensors writer would keep one tensor of each shared memory."""
    target = directory / f"step-{step}"
    with fused_layout(objective):
        accelerator.save_state(str(target))
    if accelerator.is_main_process:
        (target / "fingerprint").write_text(fingerprint)
        (target / "complete").write_text(str(step))
        for old in directory.glob("step-*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
    _wait_for_everyone(accelerator)


def _wait_for_everyone(accelerator) -> None:
    """A barrier across the training processes. accelerate's names this process's device index, and
    torch reads that as a GPU index whenever CUDA is present: CPU processes under torchrun on a
    machine with fewer GPUs than processes then die with "invalid device ordinal". Gloo needs no
    device, so CPU runs call the barrier without one."""
    if accelerator.device.type == "cpu" and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    else:
        accelerator.wait_for_everyone()


__all__ = ["TrainingConfig", "TrainingStopped", "train", "sample_order", "latest_checkpoint", "run_fingerprint"]

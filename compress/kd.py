"""Knowledge-distillation losses as plain functions on tensors.

Logit KD (Hinton et al. 2015): soften both next-token distributions with a temperature T and
match them,

    L = T² · D(softmax(z_t / T) ‖ softmax(z_s / T))  +  λ · CE(z_s, y)

where D is the forward KL (the student covers every mode of the teacher, Hinton's choice), the
reverse KL (mode-seeking, as in MiniLLM) or the Jensen-Shannon divergence (symmetric, bounded).
The T² keeps the soft loss's gradient on the same scale as the hard loss's whatever T is, since
the softened gradients shrink as 1/T².

Hidden-state KD: mean squared error, or 1 - cosine, between a student layer's hidden states and
a teacher layer's, through a learned linear projection when their widths differ.

Every loss is a mean over the positions where `mask` is true (all positions without one), so a
batch's loss does not depend on how many padding tokens it holds. Nothing here knows about
models, data or devices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DIVERGENCES = ("forward", "reverse", "jsd")


def _masked_mean(per_position: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return per_position.mean()
    mask = mask.to(per_position.dtype)
    return (per_position * mask).sum() / mask.sum().clamp(min=1)


def divergence(teacher_logits: torch.Tensor, student_logits: torch.Tensor, kind: str = "forward",
               temperature: float = 1.0) -> torch.Tensor:
    """Per-position divergence [...] between the softened distributions of [..., vocab] logits.

    forward: KL(p_t ‖ p_s); reverse: KL(p_s ‖ p_t); jsd: ½ KL(p_t ‖ m) + ½ KL(p_s ‖ m), m = ½ (p_t + p_s).
    Computed in float32 from log-probabilities, so that tiny probabilities do not underflow."""
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    if kind == "forward":
        return (log_t.exp() * (log_t - log_s)).sum(-1)
    if kind == "reverse":
        return (log_s.exp() * (log_s - log_t)).sum(-1)
    if kind == "jsd":
        log_m = torch.logsumexp(torch.stack([log_t, log_s]), dim=0) - torch.log(torch.tensor(2.0))
        return 0.5 * ((log_t.exp() * (log_t - log_m)).sum(-1) + (log_s.exp() * (log_s - log_m)).sum(-1))
    raise ValueError(f"unknown divergence {kind!r}; use one of {', '.join(DIVERGENCES)}")


def logit_kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
                  kind: str = "forward", mask: torch.Tensor | None = None) -> torch.Tensor:
    """T² · mean divergence over the (masked) positions."""
    return temperature**2 * _masked_mean(divergence(teacher_logits, student_logits, kind, temperature), mask)


def next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of a causal LM's logits [batch, seq, vocab] against the next tokens: position i
    predicts token i + 1, so the last position has no target."""
    pred, target = logits[:, :-1].float(), input_ids[:, 1:]
    per_position = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1), reduction="none")
    return _masked_mean(per_position.reshape(target.shape), None if mask is None else mask[:, 1:])


def hidden_state_loss(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, kind: str = "mse",
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """mse: mean over positions of the mean squared difference across the width; cosine: mean of
    1 - cos(student, teacher). Both [batch, seq, width], already projected to the same width."""
    s, t = student_hidden.float(), teacher_hidden.float()
    if kind == "mse":
        per_position = (s - t).pow(2).mean(-1)
    elif kind == "cosine":
        per_position = 1 - F.cosine_similarity(s, t, dim=-1)
    else:
        raise ValueError(f"unknown hidden-state loss {kind!r}; use mse or cosine")
    return _masked_mean(per_position, mask)

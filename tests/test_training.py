"""The training loop and the math under distillation and QAT: KD losses, straight-through and LSQ
gradients, the learning-rate schedule, the sample order, exact resume, and pruning masks."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from compress import kd, modeling
from compress.quant import compute_qparams, fake_quantize, fake_quantize_ste, lsq_gradient_factor, scale_gradient
from compress.stages.distill import DistillationObjective, DistillLoss
from compress.training import TrainingConfig, TrainingStopped, latest_checkpoint, sample_order, train


# -- KD losses

def test_forward_kl_matches_torch_and_vanishes_on_equal_logits():
    g = torch.Generator().manual_seed(0)
    t, s = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    ours = kd.divergence(t, s, "forward")
    ref = torch.nn.functional.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(ours, ref)
    assert float(kd.logit_kd_loss(t, t, temperature=3.0)) == pytest.approx(0.0, abs=1e-6)
    # reverse KL is the forward one with the roles swapped; JSD is symmetric and at most ln 2
    torch.testing.assert_close(kd.divergence(t, s, "reverse"), kd.divergence(s, t, "forward"))
    torch.testing.assert_close(kd.divergence(t, s, "jsd"), kd.divergence(s, t, "jsd"))
    far = kd.divergence(torch.tensor([[50.0, 0.0]]), torch.tensor([[0.0, 50.0]]), "jsd")
    assert float(far) <= math.log(2) + 1e-6 and float(far) > 0.69


def test_temperature_scaling_keeps_the_gradient_scale():
    """Hinton's T² factor: at high T the soft loss's gradient w.r.t. the student logits is
    (p_s - p_t) · T² / T, which for logits of small spread is ≈ (z_s - z_t) / V independently of T."""
    g = torch.Generator().manual_seed(1)
    t = torch.randn(1, 1, 16, generator=g) * 0.1
    grads = []
    for temperature in (4.0, 16.0):
        s = (torch.randn(1, 1, 16, generator=g) * 0.1).requires_grad_()
        kd.logit_kd_loss(s, t, temperature).backward()
        approx = (((s - t) - (s - t).mean()) / 16).detach()
        grads.append(float((s.grad - approx).abs().max() / approx.abs().max()))
    assert max(grads) < 0.05


def test_next_token_loss_matches_transformers():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=50)).eval()
    ids = torch.randint(0, 50, (2, 12))
    out = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(kd.next_token_loss(out.logits, ids), out.loss)


def test_hidden_state_losses():
    a = torch.randn(2, 3, 8)
    assert float(kd.hidden_state_loss(a, a, "mse")) == 0
    assert float(kd.hidden_state_loss(a, 2 * a, "cosine")) == pytest.approx(0.0, abs=1e-6)
    assert float(kd.hidden_state_loss(a, -a, "cosine")) == pytest.approx(2.0)
    assert float(kd.hidden_state_loss(a, a + 1, "mse")) == pytest.approx(1.0)


# -- straight-through and LSQ gradients

def test_ste_forward_is_round_to_nearest_and_passes_gradients_inside_the_range():
    torch.manual_seed(0)
    w = torch.randn(6, 32)
    qp = compute_qparams(w, 3, True, "channel")
    scale = (qp.scale * 0.8).clone()  # clip the largest weights so that both cases occur
    wq = w.clone().requires_grad_()
    out = fake_quantize_ste(wq, scale, qp.zero_point, qp.qmin, qp.qmax)
    from compress.quant import QParams, dequantize, quantize
    torch.testing.assert_close(out, dequantize(quantize(w, QParams(scale, qp.zero_point, qp.qmin, qp.qmax)), QParams(scale, qp.zero_point, qp.qmin, qp.qmax)))
    out.sum().backward()
    inside = (w / scale).abs() <= qp.qmax
    assert bool((wq.grad[inside] == 1).all()) and bool((wq.grad[~inside] == 0).all()) and bool((~inside).any())
    # grouped: the same values as fake_quantize
    qg = compute_qparams(w, 4, False, "group", 8)
    torch.testing.assert_close(fake_quantize_ste(w, qg.scale, qg.zero_point, qg.qmin, qg.qmax, 8),
                               fake_quantize(w, 4, False, "group", 8))


def test_scale_gradient_is_lsq():
    """d/ds of round(w/s)·s is round(w/s) - w/s inside the range and ±qmax where clipped (LSQ, eq. 3),
    times the gradient scale g."""
    w = torch.tensor([[0.26, -0.9, 0.05, 3.0]])
    s = torch.tensor([[0.25]], requires_grad=True)
    g = lsq_gradient_factor(4, 3)
    out = fake_quantize_ste(w, scale_gradient(s, g), torch.zeros(1, 1), -3, 3)
    out.sum().backward()
    v = w / 0.25
    expected = torch.where(v.abs() > 3, torch.sign(v) * 3, torch.round(v) - v).sum() * g
    assert float(s.grad) == pytest.approx(float(expected), rel=1e-5)
    # forward the scale exactly: (x - x·g) + x·g was off by an ulp for 1 % of float32 scales,
    # so training ran on, and the checkpoint stored, a step a hair from the learned one
    x = torch.rand(10_000) * 1e-2 + 1e-4
    assert torch.equal(scale_gradient(x, lsq_gradient_factor(256, 7)), x)


# -- schedule and data order

def test_learning_rate_schedule():
    cfg = TrainingConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert cfg.lr_factor(1) == pytest.approx(0.1) and cfg.lr_factor(10) == pytest.approx(1.0)
    assert cfg.lr_factor(100) == pytest.approx(0.1)
    assert cfg.lr_factor(55) == pytest.approx(0.55)  # halfway down the cosine
    factors = [cfg.lr_factor(s) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(factors, factors[1:]))
    assert TrainingConfig(steps=100, warmup=0.05).warmup_steps() == 5


def test_sample_order_visits_every_sample_once_per_epoch():
    cfg = TrainingConfig(batch_size=3, gradient_accumulation=2)
    n = 12  # two optimizer steps per epoch
    seen = torch.cat([sample_order(step, micro, cfg, n, seed=7) for step in (1, 2) for micro in (0, 1)])
    assert sorted(seen.tolist()) == list(range(n))
    again = torch.cat([sample_order(step, micro, cfg, n, seed=7) for step in (1, 2) for micro in (0, 1)])
    assert torch.equal(seen, again)
    nxt = torch.cat([sample_order(step, micro, cfg, n, seed=7) for step in (3, 4) for micro in (0, 1)])
    assert sorted(nxt.tolist()) == list(range(n)) and not torch.equal(nxt, seen)  # a new permutation


# -- the loop

def _pair(seed=0):
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(seed)
    teacher = LlamaForCausalLM(cfg).eval()
    torch.manual_seed(seed + 1)
    student = LlamaForCausalLM(cfg)
    return teacher, student


def _run(student, teacher, tmp, steps=6, stop_after=None, resume=False, masks=(), progress=lambda *_: None):
    ids = torch.randint(0, 64, (40, 16), generator=torch.Generator().manual_seed(3))
    objective = DistillationObjective(student, teacher, DistillLoss(temperature=2.0), causal=True)
    cfg = TrainingConfig(steps=steps, batch_size=4, gradient_accumulation=2, lr=1e-2, warmup=2, eval_every=3, save_every=2)
    return train(objective, ids[:32], ids[32:], cfg, param_groups=[{"params": list(student.parameters()), "lr": cfg.lr}],
                 device=torch.device("cpu"), seed=5, masks=masks, checkpoint_dir=tmp, resume=resume, fingerprint="f",
                 stop_after=stop_after, progress=progress)


def test_distillation_lowers_the_held_out_kd_loss(tmp_path):
    teacher, student = _pair()
    shown = []  # each step's training KD loss, as the progress line shows it (4 digits)
    result = _run(student, teacher, tmp_path / "ck", steps=12,
                  progress=lambda text, *_: shown.append(float(text.split(" kd ")[1].split()[0])) if " kd " in text else None)
    before, after = result["eval_before"]["eval_kd"], result["eval_after"]["eval_kd"]
    assert after < 0.7 * before, (before, after)
    assert [h["step"] for h in result["history"]] == [0, 3, 6, 9, 12]
    # each point of the curve averages the training loss over the steps since the one before
    assert len(shown) == 12
    for point in result["history"][1:]:
        step = point["step"]
        assert point["train_steps"] == 3 and point["tokens_seen"] == step * 4 * 2 * 16
        assert point["train_kd"] == pytest.approx(sum(shown[step - 3: step]) / 3, rel=1e-3)


def test_resume_is_exact(tmp_path):
    teacher, student = _pair()
    uninterrupted = _pair()[1]
    expected = _run(uninterrupted, teacher, tmp_path / "a")

    with pytest.raises(TrainingStopped):
        _run(student, teacher, tmp_path / "b", stop_after=4)  # checkpoints at steps 2 and 4
    assert latest_checkpoint(tmp_path / "b").name == "step-4"
    assert not list((tmp_path / "b").glob("step-2"))  # older checkpoints are removed
    fresh = _pair()[1]  # a new process: the weights come from the checkpoint
    result = _run(fresh, teacher, tmp_path / "b", resume=True)
    assert result["resumed_from_step"] == 4
    # the history too: its step-6 point averages steps 4 to 6, one of them before the stop
    assert [h["train_steps"] for h in result["history"][1:]] == [3, 3]
    assert result["history"] == expected["history"]
    a, b = uninterrupted.state_dict(), fresh.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    from compress.errors import CompressError

    teacher, student = _pair()
    with pytest.raises(TrainingStopped):
        _run(student, teacher, tmp_path, stop_after=2)
    objective = DistillationObjective(student, teacher, DistillLoss(), causal=True)
    ids = torch.randint(0, 64, (40, 16))
    with pytest.raises(CompressError, match="different run"):
        train(objective, ids[:32], ids[32:], TrainingConfig(steps=6, batch_size=4),
              param_groups=[{"params": list(student.parameters()), "lr": 1e-3}], device=torch.device("cpu"),
              checkpoint_dir=tmp_path, resume=True, fingerprint="another")


def test_masks_keep_pruned_weights_at_zero(tmp_path):
    teacher, student = _pair()
    w = student.model.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        w[:, ::2] = 0
    mask = (w != 0).float()
    _run(student, teacher, None, steps=4, masks=[(w, mask)])
    assert bool((w[:, ::2] == 0).all()) and float((w[:, 1::2] != 0).float().mean()) > 0.99


def test_default_tokenizer_round_trip_for_generated_data(tmp_path):
    """Teacher-generated sequences: the requested shape, reproducible from the seed, cached on disk
    and read back from the cache."""
    from compress.training_data import GenerateConfig, generated_sequences

    tok = AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR)
    cfg_model = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=len(tok))
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(cfg_model).eval()
    cfg = GenerateConfig(num_sequences=5, top_k=8, batch_size=2, cache_dir=str(tmp_path))
    a = generated_sequences(teacher, tok, cfg, 10, "hash", seed=1)
    assert a.shape == (5, 10) and len(list(tmp_path.glob("*.pt"))) == 1
    b = generated_sequences(teacher, tok, cfg.model_copy(update={"cache_dir": str(tmp_path / "other")}), 10, "hash", seed=1)
    assert torch.equal(a, b)  # regenerated from scratch: the same sequences
    # each sequence draws from its own generator: three at a time give the same five sequences
    c = generated_sequences(teacher, tok, cfg.model_copy(update={"cache_dir": str(tmp_path / "third"), "batch_size": 3}),
                            10, "hash", seed=1)
    assert torch.equal(a, c)
    huge = generated_sequences(teacher, tok, cfg.model_copy(update={"cache_dir": str(tmp_path / "huge")}), 10, "hash", seed=2**62)
    assert huge.shape == (5, 10)  # any --seed (seed * 1_000_003 overflowed a generator's seed)
    # hybrid sampling (LLM-QAT): after the random first token, the first 3 are the teacher's argmax
    d = generated_sequences(teacher, tok, cfg.model_copy(update={"cache_dir": str(tmp_path / "greedy"), "greedy_tokens": 3}),
                            10, "hash", seed=1)
    with torch.no_grad():
        argmax = teacher(input_ids=d).logits.argmax(-1)
    assert torch.equal(d[:, 0], a[:, 0]) and torch.equal(d[:, 1:4], argmax[:, 0:3]) and not torch.equal(d[:, 4:], argmax[:, 3:-1])
    with torch.no_grad():  # the cache is what is read: damage it recognisably
        torch.save(torch.zeros(5, 10, dtype=torch.long), next(tmp_path.glob("*.pt")))
    assert int(generated_sequences(teacher, tok, cfg, 10, "hash", seed=1).sum()) == 0
    # every continuation token is among the teacher's top-k at its position
    with torch.no_grad():
        logits = teacher(input_ids=a).logits[:, :-1]
    topk = logits.topk(8, dim=-1).indices
    assert bool((topk == a[:, 1:].unsqueeze(-1)).any(-1).all())


def test_generated_data_starts_a_new_text_after_the_teacher_ends_one(tmp_path):
    """What a teacher writes after its end-of-sequence token is not text (LLM-QAT stops there);
    the sequences went on sampling it. A row now goes on with a new text from a random first token.
    The teacher here ends a text at one token in five, and otherwise writes only 7 tokens."""
    from compress.training_data import GenerateConfig, end_of_sequence_ids, generated_sequences

    tok = AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR)
    cfg_model = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=len(tok))
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(cfg_model).eval()
    teacher.generation_config.eos_token_id = [tok.eos_token_id, 5]  # a chat model's end of turn as well
    assert end_of_sequence_ids(teacher, tok) == {tok.eos_token_id, 5}
    written = list(range(100, 107))
    head = torch.nn.Linear(32, len(tok), bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-30.0)
        head.bias[tok.eos_token_id] = 3.0
        head.bias[written] = 2.5
    teacher.lm_head = head
    cfg = GenerateConfig(num_sequences=6, top_k=8, batch_size=4, cache_dir=str(tmp_path))
    ids = generated_sequences(teacher, tok, cfg, 40, None, seed=1)
    ended = ids[:, :-1] == tok.eos_token_id
    after = ids[:, 1:][ended]
    assert ended.sum() >= 10  # the teacher does end its texts
    # a new random first token follows each end, never what the teacher would write there
    assert bool((after != tok.eos_token_id).all()) and float(torch.isin(after, torch.tensor(written)).float().mean()) < 0.1
    # elsewhere every token is the teacher's
    assert bool(torch.isin(ids[:, 1:][~ended], torch.tensor([tok.eos_token_id, *written])).all())
    # one row at a time gives the same rows
    assert torch.equal(ids, generated_sequences(teacher, tok, cfg.model_copy(update={"batch_size": 1}), 40, None, seed=1))


def test_shuffled_training_windows_come_from_every_corpus(tmp_path):
    """With corpora concatenated, the first windows all come from the first one; shuffle: true
    draws them (seeded) from the whole text."""
    from compress.training_data import TrainingData, training_sequences

    tok = AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR)
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("the cat sat on the mat.\n" * 400)
    second.write_text("zebra quartz vexed jumpy fog.\n" * 400)
    marker = tok("zebra", add_special_tokens=False)["input_ids"][0]
    def from_second(ids):
        return int((ids == marker).any(1).sum())
    cfg = TrainingData(dataset=[str(first), str(second)], seq_len=16, num_samples=20, eval_samples=2)
    train_ids, _, _ = training_sequences(cfg, tok)
    assert from_second(train_ids) == 0
    shuffled, held_out, source = training_sequences(cfg.model_copy(update={"shuffle": True}), tok, seed=3)
    assert from_second(shuffled) >= 5 and from_second(shuffled) <= 15 and "at random" in source
    again, _, _ = training_sequences(cfg.model_copy(update={"shuffle": True}), tok, seed=3)
    assert torch.equal(shuffled, again) and shuffled.shape == (20, 16) and held_out.shape == (2, 16)


def test_training_data_without_its_text_field_names_the_stages_key(tmp_path):
    """The hint named calibration.text_field, which a training stage's data does not read."""
    import json

    from compress.errors import CompressError
    from compress.training_data import TrainingData, training_sequences

    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"content": "the cat sat on the mat."}) for _ in range(50)))
    with pytest.raises(CompressError, match="no string or conversation field 'text'") as exc:
        training_sequences(TrainingData(dataset=str(tmp_path / "d.jsonl"), seq_len=8), AutoTokenizer.from_pretrained(
            modeling.DEFAULT_MODEL_DIR), stage="qat")
    assert exc.value.hint == "the field holding the text: the qat stage's data.text_field in a recipe"


def test_a_second_training_run_may_ask_for_other_accelerator_settings(tmp_path):
    """accelerate keeps one process-wide state: an earlier Accelerator with other settings (here
    bf16 autocast, as a GPU stage asks for) must not make the next training stage fail."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # whatever earlier tests left
    Accelerator(cpu=True, mixed_precision="bf16")
    teacher, student = _pair()
    result = _run(student, teacher, None, steps=2)
    assert result["steps"] == 2

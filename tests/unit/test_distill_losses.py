"""On-policy distillation's losses (strop.objectives.distill and each backend's distill.py)
against independent float64 oracles, on random logits with padding and holes.

The generalized JSD is held to a float64 port of TRL's ``GKDTrainer.generalized_jsd_loss``
(huggingface/trl at f2cd57710ae345ea6428ae95363267fcf38a3dc8,
``trl/experimental/gkd/gkd_trainer.py``; ``DistillationTrainer``'s is the same formula) with
its ``batchmean`` reduction over ``labels != -100``, called as TRL's ``compute_loss`` calls it:
on the logits shifted one column left of the labels. strop's drivers get the logits as
"hidden states" with an identity head, so the two meet on the same numbers; a linear head
then shows chunking changes neither the sum nor a gradient. The reverse-KL advantage is held
to a per-token loop.
"""

from __future__ import annotations

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jax.ad_checkpoint import print_saved_residuals

from strop.backends.jax import distill as jax_distill
from strop.backends.torch import distill as torch_distill
from strop.objectives.distill import reverse_kl_advantages, token_reverse_kl
from strop.objectives.losses import LOG_RATIO_LIMIT

ROWS, COLUMNS, VOCAB, HIDDEN = 3, 8, 11, 5
BETAS = (0.0, 0.3, 0.5, 1.0)  # 0.3: a mixture whose two weights differ
TEMPERATURES = (1.0, 0.7)
BACKENDS = ("jax", "torch")


def trl_generalized_jsd_loss(
    student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0
) -> torch.Tensor:
    """TRL's ``generalized_jsd_loss`` with ``reduction="batchmean"`` (a sum over the
    vocabulary and the kept tokens, divided by their count), line for line, in float64."""
    student_logits = student_logits / temperature
    teacher_logits = teacher_logits / temperature
    student_log_probs = F.log_softmax(student_logits, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        beta = torch.tensor(beta, dtype=student_log_probs.dtype)
        mixture_log_probs = torch.logsumexp(
            torch.stack(
                [student_log_probs + torch.log1p(-beta), teacher_log_probs + torch.log(beta)]
            ),
            dim=0,
        )
        kl_teacher = F.kl_div(
            mixture_log_probs, teacher_log_probs, reduction="none", log_target=True
        )
        kl_student = F.kl_div(
            mixture_log_probs, student_log_probs, reduction="none", log_target=True
        )
        jsd = beta * kl_teacher + (1 - beta) * kl_student
    mask = labels != -100
    jsd = jsd[mask]
    return jsd.sum() / mask.sum().clamp_min(1)


def batch(seed: int = 0):
    """Student and teacher logits ``[B, L, V]`` (float32) and a response mask ``[B, L]``: a
    left-padded prompt, right padding, an environment token's hole, and a row without a
    response token."""
    rng = np.random.default_rng(seed)
    student = (2.0 * rng.normal(size=(ROWS, COLUMNS, VOCAB))).astype(np.float32)
    teacher = (2.0 * rng.normal(size=(ROWS, COLUMNS, VOCAB))).astype(np.float32)
    mask = np.zeros((ROWS, COLUMNS), np.float32)
    mask[0, 3:] = 1  # prompt of 3, response to the end
    mask[1, 2:6] = 1  # right padding after column 5
    mask[1, 4] = 0  # an environment token between turns
    return student, teacher, mask  # row 2: no response token


def oracle(student, teacher, mask, beta, temperature) -> torch.Tensor:
    """TRL's loss on ``batch``'s arrays, as ``GKDTrainer.compute_loss`` shifts them."""
    labels = torch.where(torch.from_numpy(mask[:, 1:]) > 0, 0, -100)
    return trl_generalized_jsd_loss(
        torch.from_numpy(student[:, :-1]).double(), torch.from_numpy(teacher[:, :-1]).double(),
        labels, beta, temperature,
    )  # fmt: skip


def batchmean_weights(mask: np.ndarray) -> np.ndarray:
    """strop's loss weights for TRL's batchmean: the mask over its count of predicted tokens."""
    return mask / max(mask[:, 1:].sum(), 1.0)


def identity(x):
    return x


def jsd_and_gradient(backend, student, teacher, weights, head, *, beta, temperature, chunk):
    """``backend``'s chunked JSD sum and its gradient wrt ``student`` (the student's hidden
    states; ``h @ head`` its head when ``head`` is a matrix, the teacher's then ``head`` with
    its columns reversed; else ``identity``) and wrt the head's matrix, as float64 numpy."""
    kw = {"beta": beta, "temperature": temperature, "chunk_tokens": chunk}
    teacher_w = None if head is None else np.ascontiguousarray(head[:, ::-1])  # another head
    if backend == "jax":

        def loss(s, w):
            def student_head(h):
                return h if w is None else h @ w

            teacher_head = identity if w is None else (lambda h: h @ jnp.asarray(teacher_w))
            return jax_distill.chunked_jsd_sum(
                s, teacher, student_head, teacher_head, weights, **kw
            )

        w = None if head is None else jnp.asarray(head)
        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(jnp.asarray(student), w)
        grads = tuple(None if g is None else np.asarray(g, np.float64) for g in grads)
        return float(value), grads
    s = torch.tensor(student, requires_grad=True)
    w = None if head is None else torch.tensor(head, requires_grad=True)
    t = torch.from_numpy(teacher)
    value = torch_distill.chunked_jsd_sum(
        s, t, identity if w is None else (lambda h: h @ w),
        identity if w is None else (lambda h: h @ torch.from_numpy(teacher_w)), weights, **kw,
    )  # fmt: skip
    value.backward()
    grads = tuple(None if x is None else x.grad.double().numpy() for x in (s, w))
    return float(value), grads


@pytest.mark.parametrize(("beta", "temperature"), [(b, 0.7) for b in BETAS] + [(0.5, 1.0)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_generalized_jsd_is_trl_s(backend, beta, temperature):
    student, teacher, mask = batch()
    expected = oracle(student, teacher, mask, beta, temperature).item()
    got, _ = jsd_and_gradient(
        backend, student, teacher, batchmean_weights(mask), None,
        beta=beta, temperature=temperature, chunk=3,
    )  # fmt: skip
    assert expected > 0.1  # the two distributions differ: the comparison means something
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_student_s_gradient_is_trl_s(backend):
    student, teacher, mask = batch(1)
    logits = torch.from_numpy(student).double().requires_grad_(True)
    labels = torch.where(torch.from_numpy(mask[:, 1:]) > 0, 0, -100)
    trl_generalized_jsd_loss(
        logits[:, :-1], torch.from_numpy(teacher[:, :-1]).double(), labels, 0.5, 0.7
    ).backward()
    _, (got, _) = jsd_and_gradient(
        backend, student, teacher, batchmean_weights(mask), None,
        beta=0.5, temperature=0.7, chunk=4,
    )  # fmt: skip
    assert np.abs(logits.grad.numpy()).max() > 1e-3
    np.testing.assert_allclose(got, logits.grad.numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunks_change_neither_the_sum_nor_a_gradient(backend):
    """Through a linear head (hidden ``[B, L, E]`` -> logits ``[., V]``), one token per chunk,
    a ragged last chunk and a single chunk agree, gradients wrt the hidden states and the
    head's weights included (``beta`` only enters the per-chunk formula, held to TRL above)."""
    rng = np.random.default_rng(2)
    hidden = rng.normal(size=(2, ROWS, COLUMNS, HIDDEN)).astype(np.float32)
    head = rng.normal(size=(HIDDEN, VOCAB)).astype(np.float32)
    _, _, mask = batch()
    weights = batchmean_weights(mask)
    results = [
        jsd_and_gradient(
            backend, hidden[0], hidden[1], weights, head, beta=0.5, temperature=0.7, chunk=chunk
        )
        for chunk in (1, 5, ROWS * COLUMNS)
    ]
    (value, (d_hidden, d_head)), rest = results[0], results[1:]
    assert np.abs(d_head).max() > 1e-3
    for other_value, (other_hidden, other_head) in rest:
        np.testing.assert_allclose(other_value, value, rtol=1e-6)
        np.testing.assert_allclose(other_hidden, d_hidden, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(other_head, d_head, rtol=1e-5, atol=1e-6)


def saved_for_backward(backend, hidden, heads, weights) -> list[tuple[int, ...]]:
    """The shapes ``backend``'s chunked JSD keeps for its backward pass, from the student's
    hidden states ``hidden [2, B, L, E]`` (student, teacher) through the linear ``heads``."""
    kw = {"beta": 0.5, "temperature": 1.0, "chunk_tokens": 2}
    if backend == "jax":

        def loss(s, w):
            return jax_distill.chunked_jsd_sum(
                s, hidden[1], lambda h: h @ w, lambda h: h @ heads[1], weights, **kw
            )

        with contextlib.redirect_stdout(io.StringIO()) as printed:
            print_saved_residuals(loss, hidden[0], heads[0])
        shapes = re.findall(r"^\w+\[([\d,]*)\]", printed.getvalue(), re.MULTILINE)
        return [tuple(int(d) for d in shape.split(",") if d) for shape in shapes]
    student, head = torch.from_numpy(hidden[0]).requires_grad_(), torch.from_numpy(heads[0])
    saved = []

    def keep(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        torch_distill.chunked_jsd_sum(
            student, torch.from_numpy(hidden[1]), lambda h: h @ head.requires_grad_(),
            lambda h: h @ torch.from_numpy(heads[1]), weights, **kw,
        )  # fmt: skip
    return saved


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_backward_keeps_no_logits(backend):
    """Each chunk is recomputed in the backward pass: what the forward keeps for it is the
    hidden states and the heads' weights, never a ``[tokens, V]`` array of logits or
    log-probabilities (the memory the chunking saves)."""
    rng = np.random.default_rng(6)
    vocab = 64  # wider than any other axis here
    hidden = rng.normal(size=(2, ROWS, COLUMNS, HIDDEN)).astype(np.float32)
    heads = rng.normal(size=(2, HIDDEN, vocab)).astype(np.float32)
    _, _, mask = batch()
    saved = saved_for_backward(backend, hidden, heads, batchmean_weights(mask))
    assert saved  # the hook saw the backward's inputs
    assert [shape for shape in saved if vocab in shape and shape != (HIDDEN, vocab)] == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_what_masked_tokens_hold_reaches_neither_the_sum_nor_a_gradient(backend):
    student, teacher, mask = batch(3)
    clean = jsd_and_gradient(
        backend, student, teacher, batchmean_weights(mask), None, beta=0.5, temperature=1.0, chunk=4
    )
    off = np.zeros_like(mask, dtype=bool)
    off[:, :-1] = mask[:, 1:] == 0  # the logits no weighted token is predicted from
    student, teacher = student.copy(), teacher.copy()
    student[off], teacher[off] = np.nan, np.inf
    dirty = jsd_and_gradient(
        backend, student, teacher, batchmean_weights(mask), None, beta=0.5, temperature=1.0, chunk=4
    )
    np.testing.assert_allclose(dirty[0], clean[0], rtol=1e-6)
    np.testing.assert_allclose(dirty[1][0], clean[1][0], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_weighted_token_gives_zero(backend):
    student, teacher, _ = batch(4)
    value, (grad, _) = jsd_and_gradient(
        backend, student, teacher, np.zeros((ROWS, COLUMNS), np.float32), None,
        beta=0.5, temperature=1.0, chunk=4,
    )  # fmt: skip
    assert value == 0.0
    assert not np.any(grad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("setting", "bad"), (("beta", 1.5), ("temperature", 0.0), ("chunk_tokens", 0))
)
def test_bad_settings_are_refused_in_one_line(backend, setting, bad):
    student, teacher, mask = batch()
    drive = {"jax": jax_distill, "torch": torch_distill}[backend].chunked_jsd_sum
    kw = {"beta": 0.5, "temperature": 1.0, "chunk_tokens": 4, setting: bad}
    arrays = (student, teacher) if backend == "jax" else map(torch.from_numpy, (student, teacher))
    with pytest.raises(ValueError, match=setting.split("_")[0]):
        drive(*arrays, identity, identity, mask, **kw)


# --- reverse KL as an advantage ---------------------------------------------------------------


def reverse_kl_oracle(student, teacher, mask, task=None, reward_weight=0.0) -> np.ndarray:
    """Token by token: ``-(log p_s - log p_t) + w * A_task`` on sampled tokens, else 0."""
    out = np.zeros(mask.shape)
    for b, t in np.ndindex(*mask.shape):
        if mask[b, t] > 0:
            out[b, t] = -(float(student[b, t]) - float(teacher[b, t]))
            if reward_weight:
                out[b, t] += reward_weight * float(task[b, t])
    return out


@pytest.mark.parametrize("reward_weight", (0.0, 0.5))
def test_reverse_kl_advantages_are_the_oracle_s(reward_weight):
    rng = np.random.default_rng(5)
    _, _, mask = batch()
    student = -rng.exponential(2.0, size=mask.shape).astype(np.float32)
    teacher = -rng.exponential(2.0, size=mask.shape).astype(np.float32)
    task = rng.normal(size=mask.shape)
    off = mask == 0
    student[off], teacher[off], task[off] = np.nan, -np.inf, np.nan  # padding holds anything
    got = reverse_kl_advantages(
        student, teacher, mask, task_advantages=task, reward_weight=reward_weight
    )
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, reverse_kl_oracle(student, teacher, mask, task, reward_weight))
    assert np.all(got[off] == 0.0) and np.any(got[~off] != 0.0)


def test_a_token_the_teacher_finds_impossible_gets_a_bounded_advantage():
    student = np.array([[0.0, -0.5, -1.0]])
    teacher = np.array([[0.0, -np.inf, -2.0]])
    mask = np.array([[0, 1, 1]])
    np.testing.assert_array_equal(
        token_reverse_kl(student, teacher, mask), [[0.0, LOG_RATIO_LIMIT, 1.0]]
    )
    np.testing.assert_array_equal(
        reverse_kl_advantages(student, teacher, mask), [[0.0, -LOG_RATIO_LIMIT, -1.0]]
    )


def test_a_reward_weight_without_task_advantages_is_refused():
    _, _, mask = batch()
    with pytest.raises(ValueError, match="task"):
        reverse_kl_advantages(mask, mask, mask, reward_weight=0.5)

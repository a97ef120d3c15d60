"""On-policy distillation's generalized JSD in torch, chunk by chunk of tokens.

:func:`chunked_jsd_sum` takes the final normed hidden states of the student and the teacher
on the same ids (``run_model(..., output_hidden_states=True, logits_to_keep=1)``'s
``hidden_states[-1]``, as :mod:`strop.backends.torch.value` reads them) and each model's head
(:func:`lm_head`), keeps the tokens with a loss weight, and goes over them ``chunk_tokens`` at
a time: one chunk's full-vocabulary logits of both models are computed, fed to the core's
:func:`~strop.objectives.distill.generalized_jsd` and summed under the loss weights. Each
chunk runs under non-reentrant activation checkpointing, so the backward pass keeps only the
hidden states and recomputes one chunk's logits at a time: the ``[B, L, V]`` logits of
neither model are ever whole in memory. The JAX backend's ``distill.py`` is the same (it
pads the last chunk where this one drops the unweighted tokens: JAX's shapes are static).

:func:`jsd_micro_loss` is ``distill.loss=jsd``'s student update over one micro-batch
(``TorchActorCritic.train_jsd``): the frozen teacher's forward without gradient, the
student's with it, and the chunked JSD over both heads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from strop.backends.torch.losses import F32, OPS
from strop.backends.torch.model import LoadedModel, final_hidden
from strop.objectives.distill import (
    DEFAULT_CHUNK_TOKENS,
    JsdObjective,
    check_beta,
    check_chunk_tokens,
    check_temperature,
    generalized_jsd,
)
from strop.objectives.losses import weighted_sum

Head = Callable[[torch.Tensor], torch.Tensor]
"""A model's head: final normed hidden states ``[n, E]`` -> logits ``[n, V]``."""


def lm_head(loaded: LoadedModel) -> Head:
    """``loaded``'s head as a :data:`Head`: its output embeddings (an adapter on them
    included), in its compute dtype, then float32 and the final logit soft-cap (Gemma's)."""
    head, cap = loaded.model.get_output_embeddings(), loaded.spec.final_logit_softcap

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        with loaded.autocast():
            out = head(hidden).float()
        return out if cap is None else torch.tanh(out / cap) * cap

    return logits


def _chunk_sum(student, teacher, weights, student_head, teacher_head, beta, temperature):
    student_logp = torch.log_softmax(student_head(student).to(F32) / temperature, dim=-1)
    with torch.no_grad():
        teacher_logp = torch.log_softmax(teacher_head(teacher).to(F32) / temperature, dim=-1)
    return weighted_sum(OPS, generalized_jsd(OPS, student_logp, teacher_logp, beta), weights)


def chunked_jsd_sum(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    student_head: Head,
    teacher_head: Head,
    weights,
    *,
    beta: float,
    temperature: float,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """``sum_{b,t} weights[b, t] * JSD_beta(student || teacher)`` of the next-token
    distributions at column ``t - 1`` (a float32 scalar; differentiable wrt the student).

    ``student_hidden [B, L, E_s]`` and ``teacher_hidden [B, L, E_t]`` are the two models'
    final hidden states on the same ``[B, L]`` ids; ``weights [B, L]`` the loss weights in the
    teacher-forcing layout (column ``t`` weighs the prediction of ``x_t``), 0 off the
    response: ``mask / mask.sum()`` gives TRL's ``batchmean`` (a sum over the vocabulary and
    the tokens, divided by the tokens). The teacher gets no gradient; only the weighted
    tokens reach a head. Over no weighted token the sum is 0 (with a gradient of 0)."""
    check_beta(beta)
    check_temperature(temperature)
    check_chunk_tokens(chunk_tokens)
    token_weights = torch.as_tensor(weights, device=student_hidden.device).to(F32)[:, 1:]
    on = token_weights > 0
    student = student_hidden[:, :-1][on]
    teacher = teacher_hidden[:, :-1][on.to(teacher_hidden.device)].detach()
    token_weights = token_weights[on]
    total = student[:0].sum().to(F32)  # 0, on the student's graph even without a token
    for begin in range(0, len(token_weights), chunk_tokens):
        part = slice(begin, begin + chunk_tokens)
        total = total + checkpoint(
            _chunk_sum, student[part], teacher[part], token_weights[part], student_head,
            teacher_head, beta, temperature, use_reentrant=False,
        )  # fmt: skip
    return total


def jsd_micro_loss(
    student: LoadedModel, teacher: LoadedModel, objective: JsdObjective, micro
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A micro-batch's share of the student's JSD loss (:class:`JsdObjective`: the sum under
    its ``loss_weights``), for :meth:`~strop.backends.torch.train.Trainer.update`; stat
    ``jsd`` is the loss. ``teacher`` runs (with the adapter its role names active) without
    gradient: its hidden states and head are constants of the student's update."""
    inputs = micro["input_ids"], micro["attention_mask"], micro.get("positions")
    with torch.no_grad():
        teacher_hidden = final_hidden(teacher, *inputs)
    jsd = chunked_jsd_sum(
        final_hidden(student, *inputs), teacher_hidden, lm_head(student), lm_head(teacher),
        micro["loss_weights"], beta=objective.beta, temperature=objective.temperature,
        chunk_tokens=objective.chunk_tokens,
    )  # fmt: skip
    return jsd, {"jsd": jsd.detach()}

"""The chunked JSD on real models: each backend's heads (JAX's ``CausalLM.logits_from_hidden``,
torch's ``distill.lm_head``) over the models' final hidden states give the JSD of the models'
own full logits, for a student with its own LM head and a teacher whose head is tied to its
embeddings; the student's head gets a gradient, the teacher none.

The reference is TRL's loss, ported in ``tests/unit/test_distill_losses.py``, on the logits
each backend's ordinary forward returns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from strop.backends.jax import distill as jax_distill
from strop.backends.jax.sharding import make_mesh
from strop.backends.jax.weights import load_hf_model
from strop.backends.torch import distill as torch_distill
from strop.backends.torch.fsdp import place
from strop.backends.torch.model import build_model, forward_logits, run_model
from strop.config import MeshConfig
from tests.parity.test_value_alignment import ppo_batch
from tests.unit.test_distill_losses import batchmean_weights, oracle

STUDENT, TEACHER = "qwen2", "qwen2_tied"
SETTINGS = {"beta": 0.3, "temperature": 0.7, "chunk_tokens": 3}


def jax_case(student_dir, teacher_dir, ids, attention, weights):
    """(the chunked JSD, the oracle's inputs: both models' logits, the student's head's
    gradient) on JAX."""
    mesh = make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    student, teacher = load_hf_model(student_dir, mesh), load_hf_model(teacher_dir, mesh)
    ids, attention = jnp.asarray(ids), jnp.asarray(attention)
    teacher_out = teacher(ids, attention)
    graph, params = nnx.split(student)

    @jax.jit
    def loss(params):
        model = nnx.merge(graph, params)
        hidden = model(ids, attention).hidden
        return jax_distill.chunked_jsd_sum(
            hidden, teacher_out.hidden, model.logits_from_hidden, teacher.logits_from_hidden,
            weights, **SETTINGS,
        )  # fmt: skip

    value, grads = jax.value_and_grad(loss)(params)
    head_grad = np.asarray(grads["lm_head"]["kernel"][...])
    logits = (np.asarray(student(ids, attention).logits), np.asarray(teacher_out.logits))
    return float(value), logits, head_grad


def torch_case(student_dir, teacher_dir, ids, attention, weights):
    """The same on torch (hidden states as the critic reads them: ``logits_to_keep=1``)."""
    student, teacher = (build_model(d, place(MeshConfig())) for d in (student_dir, teacher_dir))
    ids, attention = torch.from_numpy(ids), torch.from_numpy(attention)
    with torch.no_grad():
        teacher_hidden = run_model(
            teacher, ids, attention, output_hidden_states=True, logits_to_keep=1
        ).hidden_states[-1]
        logits = tuple(forward_logits(m, ids, attention).numpy() for m in (student, teacher))
    hidden = run_model(student, ids, attention, output_hidden_states=True, logits_to_keep=1)
    value = torch_distill.chunked_jsd_sum(
        hidden.hidden_states[-1], teacher_hidden, torch_distill.lm_head(student),
        torch_distill.lm_head(teacher), weights, **SETTINGS,
    )  # fmt: skip
    value.backward()
    assert all(p.grad is None for p in teacher.model.parameters())
    head_grad = student.model.get_output_embeddings().weight.grad.numpy()
    return float(value), logits, head_grad


@pytest.mark.parametrize("backend", ("jax", "torch"))
def test_heads_over_hidden_states_give_the_models_own_jsd(backend, tiny_model_dir):
    ids, attention, mask = ppo_batch()
    weights = batchmean_weights(mask.astype(np.float32))
    case = {"jax": jax_case, "torch": torch_case}[backend]
    value, (student, teacher), head_grad = case(
        tiny_model_dir(STUDENT), tiny_model_dir(TEACHER), ids, attention, weights
    )
    beta, temperature = SETTINGS["beta"], SETTINGS["temperature"]
    expected = oracle(student, teacher, mask, beta, temperature).item()
    assert expected > 1e-3
    np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)  # float32 logits
    assert np.isfinite(head_grad).all() and np.abs(head_grad).max() > 0

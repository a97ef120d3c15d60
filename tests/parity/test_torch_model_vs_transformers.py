"""The torch backend's meta-device build gives the same model as ``from_pretrained``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import strop
from tests.tiny_models import BASE_KINDS, padded_batch


def reference_logits(model_dir, ids, mask) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        return model(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            position_ids=torch.from_numpy(positions),
        ).logits.numpy()


@pytest.mark.parametrize("kind", BASE_KINDS)
@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
def test_logits_equal_transformers(tiny_model_dir, kind, left):
    ids, mask = padded_batch(left=left)
    handle = strop.load_model(tiny_model_dir(kind), backend="torch")
    assert handle.backend == "torch" and handle.spec.family in ("qwen2", "llama")
    real = mask.astype(bool)
    ours = handle.logits(ids, mask)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(
        ours[real], reference_logits(tiny_model_dir(kind), ids, mask)[real], atol=1e-5
    )


def test_tied_weights_stay_tied_and_save_round_trips(tiny_model_dir, tmp_path):
    handle = strop.load_model(tiny_model_dir("qwen2_tied"), backend="torch")
    assert handle.model.lm_head.weight is handle.model.model.embed_tokens.weight
    ids, mask = padded_batch()
    saved = handle.save(tmp_path / "saved")
    real = mask.astype(bool)
    np.testing.assert_array_equal(
        reference_logits(saved, ids, mask)[real], handle.logits(ids, mask)[real]
    )

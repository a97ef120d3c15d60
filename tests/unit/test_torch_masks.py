"""The torch backend's masks for packed rows: a shared prompt and its rollouts, each
rollout seeing what it would see alone, sliding windows included."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from strop.backends.torch.masks import model_attention_mask, packed_attention_mask  # noqa: E402
from strop.batch.packing import PREFIX_STRIDE  # noqa: E402
from strop.errors import ModelError  # noqa: E402
from tests.tiny_models import FAMILY_KINDS  # noqa: E402

PROMPT, ROLLOUTS = 4, (5, 3)  # a prompt's first 4 tokens shared by two rollouts


def packed_prompt_row() -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """One row: the shared prefix (segment 1), then each rollout (segments 2, 3, seeing
    segment 1), then 2 padding columns; and each rollout's columns in the row."""
    packed, positions, columns = [1] * PROMPT, list(range(PROMPT)), []
    for segment, length in enumerate(ROLLOUTS, start=2):
        start = len(packed)
        packed += [segment + PREFIX_STRIDE * 1] * length
        positions += range(PROMPT, PROMPT + length)
        columns.append(list(range(PROMPT)) + list(range(start, start + length)))
    packed, positions = [*packed, 0, 0], [*positions, 0, 0]
    return torch.tensor([packed]), torch.tensor([positions]), columns


def banded(length: int, window: int | None) -> torch.Tensor:
    """A sequence alone: each token sees itself and the ``window - 1`` tokens before."""
    visible = torch.ones(length, length, dtype=torch.bool).tril()
    return visible if window is None else visible.triu(-(window - 1))


@pytest.mark.parametrize("window", [None, 2, 5, 50])
def test_each_rollout_sees_what_it_sees_alone(window):
    packed, positions, columns = packed_prompt_row()
    allowed = packed_attention_mask(packed, positions, torch.float32, window)[0, 0] == 0
    for cols in columns:
        alone = allowed[cols][:, cols]
        assert torch.equal(alone, banded(len(cols), window))
        rows = torch.tensor(cols[PROMPT:])  # a rollout sees nothing outside its sequence
        assert allowed[rows].sum(-1).tolist() == alone[PROMPT:].sum(-1).tolist()


def spec_of(kind: str):
    from strop.models import parse_config
    from tests.tiny_models import KINDS, TINY

    model_type, extra = KINDS[kind]
    return parse_config({"model_type": model_type, **TINY, **extra})


def test_layers_of_different_windows_get_a_mask_per_layer_type():
    spec = spec_of("gemma3")
    packed, positions, _ = packed_prompt_row()
    layer_types = FAMILY_KINDS["gemma3"][1]["layer_types"]
    masks = model_attention_mask(spec, layer_types, packed, positions, torch.float32)
    window = spec.sliding_windows[0]
    assert set(masks) == {"sliding_attention", "full_attention"}
    assert torch.equal(
        masks["full_attention"], packed_attention_mask(packed, positions, torch.float32)
    )
    assert torch.equal(
        masks["sliding_attention"], packed_attention_mask(packed, positions, torch.float32, window)
    )
    with pytest.raises(ModelError, match="layer_types"):
        model_attention_mask(spec, None, packed, positions, torch.float32)

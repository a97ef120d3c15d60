"""Every model family against transformers, on both backends: one test per (backend,
family) on a tiny random checkpoint carrying the family's flags (tests/tiny_models.py).

Each test checks, on sequences longer than every sliding window:
- the logits of right- and left-padded rows equal transformers' to 1e-4 (float32);
- two sequences packed into one row (segment ids, positions restarting) give each
  sequence's logits alone, and so do two continuations of a prompt packed after one copy of
  it (a shared prompt: slots far from their positions);
- greedy sampling with strop's own sampler equals transformers' ``generate``, token for
  token;
- the checkpoint strop saves holds the source checkpoint's tensor names (stacked experts
  written back one tensor per expert) and loads in transformers to the same logits.

The torch backend also runs decoders no family declares (``UNREGISTERED_KINDS``) through
the same checks, and for every kind a LoRA SFT step's PEFT adapter loads in transformers +
PEFT and gives strop's logits.

A family a backend does not build yet is listed in ``PENDING``: its test is a strict
xfail, so it fails the suite the day it starts passing (take it off the list then).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

import strop
from strop.batch.packing import PREFIX_STRIDE
from strop.io.hf import SafetensorsReader
from tests.tiny_models import FAMILY_KINDS, TINY, UNREGISTERED_KINDS, padded_batch, save_tiny_model

ATOL = 1e-4
PAD = 0
NEW_TOKENS = 10
PROMPTS = ([5, 17, 33, 8, 91, 12, 7], [44, 3], [9, 120, 61, 2, 18, 200, 31, 77, 6, 15, 99])
PENDING = {
    "jax": set(),
    "torch": set(),
}


def cases(backend: str, kinds=tuple(FAMILY_KINDS)) -> list:
    return [
        pytest.param(
            kind,
            marks=pytest.mark.xfail(strict=True, reason=f"{backend} does not build {kind} yet"),
        )
        if kind in PENDING[backend]
        else kind
        for kind in kinds
    ]


def hf_model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        )
    return out.logits.numpy()


def hf_greedy(model, prompts) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    config = GenerationConfig(
        do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=PAD
    )
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, generation_config=config)
    return out[:, width:].tolist()


def packed_row(ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, ...]:
    """Rows 0 and 2 of a right-padded batch packed one after the other into one row."""
    first, second = ids[0][mask[0] == 1], ids[2][mask[2] == 1]
    packed = np.concatenate([first, second])[None]
    segments = np.concatenate([np.full(len(first), 1), np.full(len(second), 2)])[None]
    positions = np.concatenate([np.arange(len(first)), np.arange(len(second))])[None]
    return packed, segments, positions, len(first)


def shared_prompt_row(ids: np.ndarray) -> tuple[np.ndarray, ...]:
    """Row 0's first 4 tokens (segment 1), then two continuations of them (segments 2 and
    3, each seeing segment 1 too), packed into one row as strop.batch.packing shares a
    prompt. Each token should give row 0's logits at the position it holds."""
    prompt, continuations = (0, 4), ((4, 12), (4, 9))
    packed = np.concatenate([ids[0, lo:hi] for lo, hi in (prompt, *continuations)])[None]
    segments = np.concatenate(
        [np.full(prompt[1], 1)]
        + [np.full(hi - lo, segment + PREFIX_STRIDE * 1)
           for segment, (lo, hi) in enumerate(continuations, 2)]
    )[None]  # fmt: skip
    positions = np.concatenate([np.arange(lo, hi) for lo, hi in (prompt, *continuations)])[None]
    return packed, segments, positions


def strop_greedy(backend: str, handle, model_dir: str, prompts) -> list[list[int]]:
    from strop.generation import SamplingParams

    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    if backend == "jax":
        from strop.backends.jax.generate import generate

        out = generate(handle.model, list(prompts), params, eos_ids=(), pad_id=PAD, seed=0,
                       mesh=handle.mesh)  # fmt: skip
    else:
        from strop.backends.torch.generate import generate

        out = generate(hf_model(model_dir), list(prompts), params, eos_ids=[], pad_id=PAD, seed=0)
    return out.responses()


def check_family(backend: str, model_dir: str, out_dir) -> None:
    mesh = {"fsdp": 4, "tensor": 2} if backend == "jax" else None  # weights sharded both ways
    handle = strop.load_model(model_dir, backend=backend, **({"mesh": mesh} if mesh else {}))
    reference = hf_model(model_dir)
    for left in (False, True):
        ids, mask = padded_batch(left=left)
        expected = hf_logits(reference, ids, mask)
        ours = handle.logits(ids, mask)
        valid = mask.astype(bool)
        assert np.abs(ours[valid] - expected[valid]).max() < ATOL, f"left padding: {left}"
    assert np.abs(expected).max() > 10 * ATOL  # a comparison that can fail

    ids, mask = padded_batch()
    packed, segments, positions, cut = packed_row(ids, mask)
    together = handle.logits(packed, segments, positions)[0]
    alone = hf_logits(reference, ids, mask)
    np.testing.assert_allclose(together[:cut], alone[0, :cut], atol=ATOL)
    np.testing.assert_allclose(together[cut:], alone[2, : mask[2].sum()], atol=ATOL)
    packed, segments, positions = shared_prompt_row(ids)
    shared = handle.logits(packed, segments, positions)[0]
    np.testing.assert_allclose(shared, alone[0, positions[0]], atol=ATOL)

    assert strop_greedy(backend, handle, model_dir, PROMPTS) == hf_greedy(reference, PROMPTS)

    saved = handle.save(out_dir / "saved")
    assert sorted(SafetensorsReader(saved).names()) == sorted(SafetensorsReader(model_dir).names())
    np.testing.assert_array_equal(
        hf_logits(hf_model(str(saved)), ids, mask), hf_logits(reference, ids, mask)
    )


@pytest.mark.parametrize("kind", cases("jax"))
def test_jax_family_equals_transformers(tiny_model_dir, tmp_path, kind):
    check_family("jax", tiny_model_dir(kind), tmp_path)


@pytest.mark.parametrize("kind", cases("torch", (*FAMILY_KINDS, *UNREGISTERED_KINDS)))
def test_torch_family_equals_transformers(tiny_model_dir, tmp_path, kind):
    check_family("torch", tiny_model_dir(kind), tmp_path)


@pytest.mark.parametrize("kind", [*FAMILY_KINDS, *UNREGISTERED_KINDS])
def test_torch_lora_sft_adapter_loads_in_peft_with_strop_s_logits(
    tiny_model_dir, kind, tmp_path, caplog
):
    """LoRA on every linear the built model has (targets matched by name against its
    ``nn.Linear`` paths), one SFT step, the adapter exported: ``PeftModel.from_pretrained``
    over transformers' model gives strop's logits. A decoder no family declares runs
    with one notice at preflight's ``check_model``."""
    from peft import PeftModel

    from strop.backends import get_backend
    from strop.backends.torch.model import forward_logits
    from strop.io.model_spec import read_model_spec
    from tests.distributed.cases import global_batch
    from tests.integration.test_torch_lora_training import policy_for

    model_dir = tiny_model_dir(kind)
    with caplog.at_level("WARNING", logger="strop.backends.torch.model"):
        get_backend("torch").check_model(read_model_spec(model_dir))
    notices = [r.getMessage() for r in caplog.records if "not a family" in r.getMessage()]
    assert len(notices) == (kind in UNREGISTERED_KINDS)
    # PEFT reads a routed MoE's `.*_proj` as its stacked experts too, which strop refuses
    targets = r"[.*self_attn\..*_proj, lm_head]" if kind == "qwen3_moe" else "[.*_proj, lm_head]"
    policy = policy_for(model_dir, tmp_path, f"lora.target_modules={targets}")
    policy.train_step(global_batch(), micro_batches=1)
    adapter = policy.export_adapter(tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(hf_model(model_dir), adapter).eval()

    ids, mask = padded_batch()
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    arrays = (torch.from_numpy(a) for a in (ids, mask, positions))
    with torch.no_grad():
        ours = forward_logits(policy.loaded, *arrays).numpy()
    valid = mask.astype(bool)
    base = hf_logits(hf_model(model_dir), ids, mask)
    assert np.abs(ours[valid] - base[valid]).max() > 10 * ATOL  # the step moved them
    np.testing.assert_allclose(hf_logits(peft_model, ids, mask)[valid], ours[valid], atol=ATOL)


def test_the_prompts_cross_every_sliding_window():
    windows = [extra.get("sliding_window", 0) for _, extra in FAMILY_KINDS.values()]
    assert max(len(p) for p in PROMPTS) > max(windows) and TINY["vocab_size"] > 200


def test_jax_gemma3_soft_caps_are_transformers(tmp_path):
    """Gemma 3 with soft caps small enough to bind (the tiny model's logits reach about
    0.6): its final logits are capped as transformers caps them, and its attention-logit
    cap, which transformers' Gemma 3 keeps in its config but never applies, is not applied."""
    import jax

    from strop.backends.jax.sharding import make_mesh

    caps = {"final_logit_softcapping": 0.3, "attn_logit_softcapping": 0.05}
    model_dir = str(save_tiny_model("gemma3", tmp_path, **caps))
    mesh = make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    ours = strop.load_model(model_dir, mesh=mesh).logits(*padded_batch())
    ids, mask = padded_batch()
    expected = hf_logits(hf_model(model_dir), ids, mask)
    valid = mask.astype(bool)
    assert np.abs(ours[valid] - expected[valid]).max() < ATOL
    uncapped = AutoModelForCausalLM.from_pretrained(model_dir, final_logit_softcapping=None)
    assert np.abs(hf_logits(uncapped, ids, mask) - expected).max() > 10 * ATOL  # it binds

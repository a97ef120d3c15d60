"""The JAX sampler against transformers' ``generate`` and against teacher-forced forwards.

Shapes are shared between tests where possible (4 prompts of at most 16 tokens, 12 new
tokens) so that the jitted prefill and decode compile few times per session.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import strop
from strop.backends.jax.generate import TRACES, generate, prompt_bucket
from strop.backends.jax.handle import JaxModelHandle
from strop.backends.jax.lora import apply_lora, dense_modules
from strop.backends.jax.sharding import make_mesh
from strop.config import LoraConfig
from strop.data import Tokenizer
from strop.generation import SamplingParams
from strop.rl import Rollout, token_mult_prob_error
from tests.hlo import ops_inside_loops
from tests.tiny_models import FAMILY_KINDS, TINY
from tests.tiny_tokenizer import save_tiny_tokenizer

PAD = 0
NEW_TOKENS = 12
PROMPT_LENGTHS = (5, 12, 3, 9)
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)


def one_device_mesh():
    return make_mesh({"fsdp": 1}, devices=jax.devices()[:1])


def load(model_dir: str, mesh=None) -> JaxModelHandle:
    return strop.load_model(model_dir, mesh=mesh if mesh is not None else one_device_mesh())


def ragged_prompts(seed: int = 0, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, TINY["vocab_size"], size=n).tolist() for n in lengths]


def sample(handle: JaxModelHandle, prompts, params: SamplingParams, *, eos_ids=(), seed=0):
    return generate(
        handle.model, prompts, params, eos_ids=eos_ids, pad_id=PAD, seed=seed, mesh=handle.mesh
    )


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer")))


def hf_greedy(model_dir: str, prompts, max_new_tokens: int, eos_ids) -> list[list[int]]:
    """transformers' greedy responses (left padding), each cut after its first EOS."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # only the EOS ids passed below
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), PAD, dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=list(eos_ids) or None,
            pad_token_id=PAD,
        )
    responses = []
    for row in out[:, width:].tolist():
        ends = [i for i, token in enumerate(row) if token in eos_ids]
        responses.append(row[: ends[0] + 1] if ends else row)
    return responses


def pick_mid_eos(responses: list[list[int]]) -> int:
    """A token some row emits first mid-way (step >= 2) and some other row never emits."""
    for row in responses:
        for step in range(2, len(row) - 2):
            token = row[step]
            if token not in row[:step] and any(token not in other for other in responses):
                return token
    raise AssertionError(f"no usable EOS candidate in {responses}")


def teacher_forced_logprobs(handle: JaxModelHandle, rollout: Rollout, temperature: float):
    """Log-probs of every token under ``logits / temperature`` of a full forward, in the
    rollout's teacher-forcing layout (column j: log p(x_j | x_<j)), and that batch."""
    batch = rollout.teacher_forcing_batch(PAD)
    logits = handle.logits(batch["input_ids"], batch["attention_mask"]) / temperature
    logprobs = torch.log_softmax(torch.tensor(logits[:, :-1]), dim=-1).numpy()
    targets = batch["input_ids"][:, 1:, None]
    out = np.zeros(batch["input_ids"].shape, dtype=np.float32)
    out[:, 1:] = np.take_along_axis(logprobs, targets, axis=-1)[..., 0]
    return out, batch, logits


@pytest.mark.parametrize("kind", ["qwen2", "llama3"])
def test_greedy_matches_transformers_with_mid_batch_eos(tiny_model_dir, kind):
    model_dir = tiny_model_dir(kind)
    handle = load(model_dir)
    prompts = ragged_prompts()

    without_eos = hf_greedy(model_dir, prompts, NEW_TOKENS, eos_ids=[])
    ours = sample(handle, prompts, GREEDY)
    assert ours.responses() == without_eos
    assert ours.finish_reasons == ["length"] * len(prompts)

    eos = pick_mid_eos(without_eos)
    expected = hf_greedy(model_dir, prompts, NEW_TOKENS, eos_ids=[eos])
    ours = sample(handle, prompts, GREEDY, eos_ids=[eos])
    assert ours.responses() == expected
    stopped = [row[-1] == eos for row in expected]
    assert any(stopped) and not all(stopped)
    assert ours.lengths.tolist() == [len(row) for row in expected]
    assert ours.finish_reasons == ["stop" if s else "length" for s in stopped]
    assert ours.tokens.shape == (len(prompts), max(len(row) for row in expected))
    assert (ours.tokens[ours.mask == 0] == PAD).all()
    assert (ours.logprobs[ours.mask == 0] == 0).all()


def test_sampled_logprobs_match_teacher_forcing(tiny_model_dir, tokenizer):
    handle = load(tiny_model_dir("qwen2"))
    prompts = ragged_prompts(seed=1)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.7, top_k=20)
    first = sample(handle, prompts, params, seed=3)
    # With the same seed, an EOS that row 0 sampled at step 4 ends row 0 there.
    eos = int(first.tokens[0, 4])
    generation = sample(handle, prompts, params, eos_ids=[eos], seed=3)
    assert generation.lengths[0] <= 5 and generation.finish_reasons[0] == "stop"
    assert generation.lengths.min() < generation.lengths.max()

    rollout = Rollout.from_generation(prompts, generation, tokenizer)
    recomputed, batch, _ = teacher_forced_logprobs(handle, rollout, params.temperature)
    sampled = rollout.align(rollout.logprobs)
    mask = batch["response_mask"]
    assert mask.sum() == generation.lengths.sum()
    np.testing.assert_allclose(sampled[mask > 0], recomputed[mask > 0], atol=1e-4)
    error = token_mult_prob_error(sampled, recomputed, mask)
    print(f"token_mult_prob_error = {error:.8f}")
    assert 1.0 <= error < 1.0 + 1e-4
    assert rollout.response_texts[1] == tokenizer.decode(
        generation.responses()[1], skip_special_tokens=True
    )


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.5), (20, 0.6)], ids=["top_p", "top_k_top_p"])
def test_top_k_top_p_never_leave_the_allowed_set(tiny_model_dir, tokenizer, top_k, top_p):
    handle = load(tiny_model_dir("qwen2"))
    lengths = np.random.default_rng(2).integers(1, 13, size=64)
    prompts = ragged_prompts(seed=2, lengths=lengths)
    params = SamplingParams(max_new_tokens=16, temperature=0.5, top_k=top_k, top_p=top_p)
    generation = sample(handle, prompts, params, seed=5)
    assert (generation.lengths == 16).all()

    rollout = Rollout.from_generation(prompts, generation, tokenizer)
    _, _, scaled = teacher_forced_logprobs(handle, rollout, params.temperature)
    width = rollout.prompt_width
    logits = scaled[:, width - 1 : -1].reshape(-1, scaled.shape[-1])  # predict each response token
    tokens = generation.tokens.reshape(-1)
    order = np.argsort(-logits, axis=-1, kind="stable")
    ranks = np.argmax(order == tokens[:, None], axis=-1)
    candidates = np.take_along_axis(logits, order[:, : top_k or None], axis=-1)
    probs = np.exp(candidates - candidates.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    mass_before = np.cumsum(probs, axis=-1) - probs
    if top_k:
        assert ranks.max() < top_k
    assert (np.take_along_axis(mass_before, ranks[:, None], axis=-1) < top_p).all()
    # Not degenerate: the draws spread over the allowed set.
    nucleus = (mass_before < top_p).sum(-1)
    assert len(np.unique(ranks)) >= min(3, int(nucleus.min()))


def test_temperature_zero_and_top_k_one_are_greedy(tiny_model_dir):
    handle = load(tiny_model_dir("llama3"))
    prompts = ragged_prompts(seed=4)
    greedy = sample(handle, prompts, GREEDY)
    cold = sample(handle, prompts, SamplingParams(NEW_TOKENS, 0.0, top_k=3, top_p=0.5), seed=9)
    top1 = sample(handle, prompts, SamplingParams(NEW_TOKENS, 1.0, top_k=1), seed=9)
    for other in (cold, top1):
        np.testing.assert_array_equal(other.tokens, greedy.tokens)
        np.testing.assert_allclose(other.logprobs, greedy.logprobs, atol=1e-6)


def test_decode_compiles_once_per_bucket(tiny_model_dir):
    handle = load(tiny_model_dir("qwen2"))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)
    sample(handle, ragged_prompts(seed=5), params)  # compiles, unless another test did
    prefills, decodes = TRACES.prefill, TRACES.decode
    assert prompt_bucket(max(PROMPT_LENGTHS)) == prompt_bucket(16) == 16
    sample(handle, ragged_prompts(seed=6, lengths=(16, 1, 2, 8)), params, seed=1)
    assert (TRACES.prefill, TRACES.decode) == (prefills, decodes)
    sample(handle, ragged_prompts(seed=6, lengths=(17, 1, 2, 8)), params)  # bucket 32
    assert (TRACES.prefill, TRACES.decode) == (prefills + 1, decodes + 1)


@pytest.mark.multidevice
def test_sharded_mesh_matches_one_device(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2")
    prompts = ragged_prompts(seed=7)
    single = load(model_dir)
    sharded = load(model_dir, mesh={"fsdp": 4, "tensor": 2})
    assert dict(sharded.mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
    for params in (GREEDY, SamplingParams(NEW_TOKENS, temperature=1.0)):
        expected = sample(single, prompts, params, seed=11)
        ours = sample(sharded, prompts, params, seed=11)
        np.testing.assert_array_equal(ours.tokens, expected.tokens)
        np.testing.assert_allclose(ours.logprobs, expected.logprobs, atol=1e-5)
        assert ours.lengths.tolist() == expected.lengths.tolist()

    greedy = sample(single, prompts, GREEDY).tokens
    # Without a mesh argument, generation runs on the mesh the weights are on.
    default = generate(sharded.model, prompts, GREEDY, eos_ids=[], pad_id=PAD, seed=0)
    np.testing.assert_array_equal(default.tokens, greedy)
    # 3 rows do not split over fsdp=4: a dummy row pads the batch and is dropped.
    np.testing.assert_array_equal(sample(sharded, prompts[:3], GREEDY).tokens, greedy[:3])


def test_seed_determines_samples(tiny_model_dir):
    handle = load(tiny_model_dir("qwen2"))
    prompts = ragged_prompts(seed=8)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)
    a, b = sample(handle, prompts, params, seed=1), sample(handle, prompts, params, seed=1)
    c = sample(handle, prompts, params, seed=2)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert (a.tokens != c.tokens).mean() > 0.5


def test_stop_strings_cut_after_the_completing_token(tiny_model_dir, tokenizer):
    handle = load(tiny_model_dir("qwen2"))
    prompts = ragged_prompts(seed=9)
    full = sample(handle, prompts, GREEDY).responses()
    row = full[0]
    step, stop = next(
        (s, piece)
        for s in range(2, len(row))
        if (piece := tokenizer.decode([row[s]])).isascii()
        and piece.strip()
        and piece not in tokenizer.decode(row[:s])
    )
    params = SamplingParams(NEW_TOKENS, temperature=0.0, stop_strings=(stop,))
    cut = generate(
        handle.model, prompts, params, eos_ids=[], pad_id=PAD, seed=0, tokenizer=tokenizer
    )
    assert cut.responses()[0] == row[: step + 1]
    assert cut.finish_reasons[0] == "stop"
    for response, original, reason in zip(cut.responses(), full, cut.finish_reasons, strict=True):
        assert original[: len(response)] == response
        assert (reason == "stop") == (stop in tokenizer.decode(original))
    with pytest.raises(ValueError, match="tokenizer"):
        generate(handle.model, prompts, params, eos_ids=[], pad_id=PAD, seed=0)


def test_lora_model_samples_from_its_own_logits(tiny_model_dir, tokenizer):
    handle = load(tiny_model_dir("qwen2"))
    lora = apply_lora(handle.model, LoraConfig(enabled=True, rank=4, alpha=8), seed=0)
    for module in dense_modules(lora).values():  # B starts at 0: make the adapters count
        if hasattr(module, "kernel_lora_b"):
            b = module.kernel_lora_b
            b.set_value(b.get_value() + 0.5)
    lora_handle = JaxModelHandle(lora, handle.mesh)
    prompts = ragged_prompts(seed=10)
    generation = sample(lora_handle, prompts, GREEDY)
    assert generation.responses() != sample(handle, prompts, GREEDY).responses()
    # Greedy tokens are the argmax of a teacher-forced forward over prompt + response.
    rollout = Rollout.from_generation(prompts, generation, tokenizer)
    batch = rollout.teacher_forcing_batch(PAD)
    logits = lora_handle.logits(batch["input_ids"], batch["attention_mask"])
    width = rollout.prompt_width
    np.testing.assert_array_equal(logits[:, width - 1 : -1].argmax(-1), generation.tokens)


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
ORIGINAL_DECODE: dict = {}


def decode_loop_collectives(handle: JaxModelHandle, monkeypatch) -> dict[str, int]:
    """Collectives in the compiled decode loop's body when ``handle`` samples."""
    from strop.backends.jax import generate as sampler

    compiled: list[str] = []
    decode = ORIGINAL_DECODE.setdefault("jit", sampler._decode)  # not a wrapper of an earlier call

    def compiling(*args):
        compiled.append(decode.lower(*args).compile().as_text())
        return decode(*args)

    monkeypatch.setattr(sampler, "_decode", compiling)
    sample(handle, ragged_prompts(seed=9, lengths=(5, 12, 3, 9, 4, 7, 2, 16)),
           SamplingParams(max_new_tokens=4, temperature=1.0))  # fmt: skip
    (hlo,) = compiled
    return {op: len(ops_inside_loops(hlo, op)) for op in COLLECTIVES}


@pytest.mark.multidevice
def test_decode_steps_run_no_collective_on_an_fsdp_sharded_model(tiny_model_dir, monkeypatch):
    """Training shards the weights over ``fsdp``; the sampler lays them out for inference
    once per call (replicated over the batch axes, :func:`inference_layout`), so no decode
    step gathers a weight, nor anything else. Outputs are unchanged: see the sharded-mesh
    test above."""
    from strop.backends.jax import generate as sampler

    handle = load(tiny_model_dir("qwen2"), mesh={"fsdp": 8})
    assert decode_loop_collectives(handle, monkeypatch) == dict.fromkeys(COLLECTIVES, 0)
    # the check can fail: on the training layout XLA communicates at every step
    monkeypatch.setattr(sampler, "inference_layout", lambda model: model)
    assert sum(decode_loop_collectives(handle, monkeypatch).values()) > 0


def test_a_prompt_s_rollouts_prefill_it_once_and_sample_what_each_row_would(tiny_model_dir):
    """Rollouts of one prompt side by side (as the PPO loop asks) prefill each prompt once
    and copy its cache: the tokens and log-probabilities of prefilling every row."""
    import strop.backends.jax.generate as sampler

    handle = load(tiny_model_dir("qwen2"))
    prompts = [p for p in ragged_prompts(seed=3) for _ in range(3)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)
    prefill = sampler._prefill
    rows = []  # the prefill's rows, per call

    def counted(model, ids, *rest):
        rows.append(len(ids))
        return prefill(model, ids, *rest)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampler, "_prefill", counted)
        shared = sample(handle, prompts, params, seed=4)
        patch.setattr(sampler, "prompt_repeats", lambda prompts: 1)
        apart = sample(handle, prompts, params, seed=4)
    assert rows == [len(prompts) // 3, len(prompts)]
    np.testing.assert_array_equal(shared.tokens, apart.tokens)
    np.testing.assert_allclose(shared.logprobs, apart.logprobs, atol=1e-5)
    assert len({tuple(r) for r in shared.tokens.tolist()}) > len(prompts) // 3  # rows differ


@pytest.mark.parametrize(
    "kind",
    [kind if kind == "ministral" else pytest.param(kind, marks=pytest.mark.acceptance)
     for kind in FAMILY_KINDS],
)  # fmt: skip
def test_continuing_a_cache_samples_what_re_prefilling_does_on_every_family(tiny_model_dir, kind):
    """On every family (in `make test`: Ministral, sliding-window layers of window 5 and
    full ones; the others in the acceptance tier), the continuation sampler (each row's
    cached keys shifted from its slot into re-prefill's columns, a chunk run after them)
    samples the tokens and log-probabilities of re-prefilling every row, over a turn that
    crosses the windows many times."""
    from strop.agents.continuation import SlotAssignment
    from strop.backends.jax.continuation import JaxContinuation
    from strop.generation import Decoding

    handle = load(tiny_model_dir(kind))
    prompts = ragged_prompts(seed=5)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    session = JaxContinuation(lambda: handle.model, Decoding(0, (), PAD, None), mesh=handle.mesh)
    slots = list(range(len(prompts)))
    first = session.generate(prompts, params, 7, SlotAssignment(slots, [0] * len(slots)))
    np.testing.assert_array_equal(first.tokens, sample(handle, prompts, params, seed=7).tokens)
    turns = [t[:n].tolist() for t, n in zip(first.tokens, first.lengths, strict=True)]
    follow = [p + t + [11, 12, 13] for p, t in zip(prompts, turns, strict=True)]
    cached = [len(p) + len(t) - 1 for p, t in zip(prompts, turns, strict=True)]
    second = session.generate(follow, params, 8, SlotAssignment(slots, cached))
    expected = sample(handle, follow, params, seed=8)
    np.testing.assert_array_equal(second.tokens, expected.tokens)
    np.testing.assert_allclose(second.logprobs, expected.logprobs, atol=1e-5)


def test_longrope_crossing_mid_decode_recomputes_the_cache_as_transformers(tiny_model_dir):
    """Phi-3's prompts prefill under original_max_position_embeddings (8: short factors)
    and decode past it: transformers' generate recomputes the whole cache with the long
    factors at the step that crosses it (Phi3ForCausalLM.prepare_inputs_for_generation),
    and so does the JAX sampler: the same tokens, with the same log-probabilities."""
    model_dir = tiny_model_dir("phi3")
    prompts = ragged_prompts(lengths=(5, 3, 7))
    ours = sample(load(model_dir), prompts, GREEDY)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = np.zeros((len(prompts), 7), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, 7 - len(prompt) :] = prompt
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(ids != 0).long(),
            do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=PAD,
            return_dict_in_generate=True, output_logits=True,
        )  # fmt: skip
    tokens = out.sequences[:, 7:]
    logits = torch.stack(out.logits, dim=1)  # [B, T, V]
    logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    assert ours.responses() == tokens.tolist()
    np.testing.assert_allclose(ours.logprobs, logprobs.numpy(), atol=1e-4)

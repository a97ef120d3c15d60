"""The torch sampler against transformers: greedy `generate`, teacher-forced logprobs,
top-k/top-p support, seeding, PEFT models and stop strings, on tiny random models."""

from __future__ import annotations

import collections
import contextlib

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from strop.backends.torch.generate import generate
from strop.generation import SamplingParams
from tests.tiny_models import FAMILY_KINDS

PAD = 0
VOCAB = 256  # tests.tiny_models.TINY["vocab_size"]
ATOL = 1e-4


def load(model_dir: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    return {kind: load(tiny_model_dir(kind)) for kind in ("qwen2", "llama3")}


def ragged_prompts(seed: int = 0, lengths=(7, 3, 5, 1, 9)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, size=n).tolist() for n in lengths]


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def hf_greedy(model, prompts, max_new_tokens: int, eos: int | None) -> list[list[int]]:
    """transformers' greedy responses, each cut after its first EOS."""
    ids, mask = left_pad(prompts)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=PAD
    )
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, generation_config=config)
    responses = []
    for row in out[:, ids.shape[1] :].tolist():
        responses.append(row[: row.index(eos) + 1] if eos in row else row)
    return responses


def teacher_forced_logits(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Float32 logits ``[len(response), V]`` predicting each response token (no padding)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) + len(response) - 1]


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)


@pytest.mark.parametrize("kind", ["qwen2", "llama3"])
def test_greedy_matches_transformers_generate_with_eos_mid_batch(models, kind):
    model, prompts, steps = models[kind], ragged_prompts(), 12
    free = hf_greedy(model, prompts, steps, eos=None)
    assert all(len(r) == steps for r in free)
    # An EOS that some row first emits mid-way (step >= 2) and some other row never emits.
    eos = next(
        tok
        for row in free
        for step, tok in enumerate(row)
        if 2 <= step < steps - 2 and tok not in row[:step] and any(tok not in r for r in free)
    )
    unused = next(t for t in range(1, VOCAB) if all(t not in r for r in free))
    expected = [r[: r.index(eos) + 1] if eos in r else r for r in free]
    assert hf_greedy(model, prompts, steps, eos=eos) == expected

    out = generate(model, prompts, greedy(steps), eos_ids=[unused, eos], pad_id=PAD, seed=0)

    assert out.responses() == expected
    assert out.lengths.tolist() == [len(r) for r in expected]
    assert out.finish_reasons == ["stop" if eos in r else "length" for r in expected]
    assert {"stop", "length"} <= set(out.finish_reasons)
    assert out.tokens.shape == (len(prompts), steps) and out.tokens.dtype == np.int32
    assert out.logprobs.dtype == np.float32 and out.lengths.dtype == np.int32
    assert (out.tokens[out.mask == 0] == PAD).all()
    assert (out.logprobs[out.mask == 0] == 0).all()
    assert not model.training

    # Without EOS ids every row runs to max_new_tokens.
    out = generate(model, prompts, greedy(steps), eos_ids=[], pad_id=PAD, seed=0)
    assert out.responses() == free and out.finish_reasons == ["length"] * len(prompts)


def test_output_width_is_the_longest_response(models):
    model, prompts = models["qwen2"], ragged_prompts(1)
    free = hf_greedy(model, prompts, 6, eos=None)
    eos_ids = sorted({r[1] for r in free})  # every row stops by step 1
    out = generate(model, prompts, greedy(6), eos_ids=eos_ids, pad_id=PAD, seed=0)
    assert out.finish_reasons == ["stop"] * len(prompts)
    assert out.tokens.shape[1] == out.lengths.max() <= 2


@pytest.mark.parametrize(
    ("temperature", "top_k"), [(0.7, 20), (0.0, 0)], ids=["t0.7_top20", "greedy"]
)
def test_logprobs_match_teacher_forced_forward(models, temperature, top_k):
    model, prompts = models["llama3"], ragged_prompts(2)
    params = SamplingParams(max_new_tokens=10, temperature=temperature, top_k=top_k)
    out = generate(model, prompts, params, eos_ids=[], pad_id=PAD, seed=3)
    for prompt, response, logprobs in zip(prompts, out.responses(), out.logprobs, strict=True):
        logits = teacher_forced_logits(model, prompt, response)
        scaled = logits / temperature if temperature else logits
        expected = torch.log_softmax(scaled, -1).gather(-1, torch.tensor(response)[:, None])
        np.testing.assert_allclose(logprobs, expected[:, 0].numpy(), atol=ATOL, rtol=0)
        if top_k:
            kth = scaled.topk(top_k, dim=-1).values[:, -1]
            assert (scaled.gather(-1, torch.tensor(response)[:, None])[:, 0] >= kth - ATOL).all()


@pytest.mark.parametrize(
    ("top_k", "top_p"), [(5, 1.0), (0, 0.5), (20, 0.7)], ids=["top5", "top_p0.5", "top20_p0.7"]
)
def test_samples_stay_in_top_k_and_top_p(models, top_k, top_p):
    """64 rows x 16 tokens; the allowed set comes from teacher-forced logits."""
    model, temperature, steps = models["qwen2"], 0.8, 16
    prompt = ragged_prompts(4, lengths=(6,))[0]
    params = SamplingParams(max_new_tokens=steps, temperature=temperature, top_k=top_k, top_p=top_p)
    out = generate(model, [prompt] * 64, params, eos_ids=[], pad_id=PAD, seed=5)
    assert out.tokens.shape == (64, steps)
    assert len(set(out.tokens[:, 0].tolist())) > 1  # rows draw independent noise

    ids = torch.cat([torch.tensor([prompt] * 64), torch.tensor(out.tokens, dtype=torch.long)], 1)
    with torch.no_grad():
        logits = model(ids).logits.float()[:, len(prompt) - 1 : -1] / temperature
    drawn = logits.gather(-1, torch.tensor(out.tokens, dtype=torch.long)[..., None])  # [64,N,1]
    allowed = logits
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        assert (drawn >= kth - ATOL).all()
        allowed = logits.masked_fill(logits < kth, -torch.inf)
    probs = allowed.softmax(-1)
    mass_above = (probs * (logits > drawn + ATOL)).sum(-1)  # of tokens likelier than the draw
    assert (mass_above < top_p + ATOL).all()


def test_sampling_follows_the_top_k_distribution(models):
    """4096 one-token draws from one prompt: the empirical law is the top-k softmax."""
    model, temperature, top_k = models["qwen2"], 0.1, 8
    prompt = ragged_prompts(6, lengths=(4,))[0]
    params = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k)
    out = generate(model, [prompt] * 4096, params, eos_ids=[], pad_id=PAD, seed=7)
    logits = teacher_forced_logits(model, prompt, [0])[0] / temperature
    top = logits.topk(top_k)
    expected = top.values.softmax(-1).numpy()
    counts = np.array([(out.tokens[:, 0] == t).sum() for t in top.indices.tolist()])
    assert counts.sum() == 4096
    assert expected.max() > 2 * expected.min()  # far from uniform, so the test is sensitive
    assert 0.5 * np.abs(counts / 4096 - expected).sum() < 0.04


def test_temperature_zero_is_greedy_whatever_top_k_top_p_and_seed(models):
    model, prompts = models["qwen2"], ragged_prompts(8)
    plain = generate(model, prompts, greedy(8), eos_ids=[], pad_id=PAD, seed=0)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, top_k=3, top_p=0.3)
    other = generate(model, prompts, params, eos_ids=[], pad_id=PAD, seed=123)
    np.testing.assert_array_equal(other.tokens, plain.tokens)
    np.testing.assert_array_equal(other.logprobs, plain.logprobs)


def test_same_seed_same_samples_other_seed_other_samples(models):
    model, prompts = models["llama3"], ragged_prompts(9)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)

    def run(seed):
        return generate(model, prompts, params, eos_ids=[], pad_id=PAD, seed=seed)

    first, again, other = run(11), run(11), run(12)
    np.testing.assert_array_equal(first.tokens, again.tokens)
    np.testing.assert_array_equal(first.logprobs, again.logprobs)
    assert (first.tokens != other.tokens).any()


def test_peft_model_greedy_matches_its_generate_and_mode_is_restored(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    base = load(tiny_model_dir("qwen2"))
    prompts, steps = ragged_prompts(10), 10
    base_out = hf_greedy(base, prompts, steps, eos=None)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    expected = hf_greedy(model, prompts, steps, eos=None)
    assert expected != base_out  # the adapters change the outputs

    model.train()
    out = generate(model, prompts, greedy(steps), eos_ids=[], pad_id=PAD, seed=0)
    assert out.responses() == expected
    assert model.training and all(m.training for m in model.modules())
    model.eval()
    generate(model, prompts, greedy(2), eos_ids=[], pad_id=PAD, seed=0)
    assert not any(m.training for m in model.modules())


class CommaTokenizer:
    """Decodes token ``i`` as ``"i,"``, so a stop string can straddle tokens."""

    def decode(self, ids):
        return "".join(f"{i}," for i in ids)


def test_stop_strings_cut_after_the_token_completing_them(models):
    model, prompts, steps = models["qwen2"], ragged_prompts(12), 12
    free = generate(model, prompts, greedy(steps), eos_ids=[], pad_id=PAD, seed=0).responses()
    row0 = free[0]
    stops = (f",{row0[3]},{row0[4]}", "no such text")  # completed by row 0's token 4 at latest
    tok = CommaTokenizer()

    def first_stop(response):  # brute force: the shortest prefix containing a stop string
        return next(
            (
                k
                for k in range(1, len(response) + 1)
                if any(s in tok.decode(response[:k]) for s in stops)
            ),
            None,
        )

    cuts = [first_stop(r) for r in free]
    assert cuts[0] is not None and cuts[0] <= 5 and None in cuts

    params = SamplingParams(max_new_tokens=steps, temperature=0.0, stop_strings=stops)
    out = generate(model, prompts, params, eos_ids=[], pad_id=PAD, seed=0, tokenizer=tok)
    assert out.responses() == [r if k is None else r[:k] for r, k in zip(free, cuts, strict=True)]
    assert out.finish_reasons == ["length" if k is None else "stop" for k in cuts]
    assert (out.tokens[out.mask == 0] == PAD).all() and (out.logprobs[out.mask == 0] == 0).all()


def test_rejects_bad_arguments(models):
    model = models["qwen2"]
    with pytest.raises(ValueError, match="tokenizer"):
        params = SamplingParams(max_new_tokens=2, stop_strings=("x",))
        generate(model, [[1, 2]], params, eos_ids=[], pad_id=PAD, seed=0)
    with pytest.raises(ValueError, match="non-empty"):
        generate(model, [[1], []], greedy(2), eos_ids=[], pad_id=PAD, seed=0)
    with pytest.raises(ValueError, match="top_p"):
        params = SamplingParams(max_new_tokens=2, top_p=0.0)
        generate(model, [[1]], params, eos_ids=[], pad_id=PAD, seed=0)


def test_the_cache_goes_by_the_name_this_transformers_release_reads(models, tiny_model_dir):
    """transformers 5.2x renamed the forward's ``past_key_values`` to ``cache`` (the old
    name warns, and goes in 5.40); the vLLM environment's 5.19 knows only the old one.
    The sampler passes the one the model's forward declares: no deprecation warning,
    with a bare model and through PEFT's wrapper."""
    import inspect
    import warnings

    import peft

    model = models["qwen2"]
    declared = inspect.signature(type(model).forward).parameters
    lora = peft.get_peft_model(
        load(tiny_model_dir("qwen2")), peft.LoraConfig(r=2, target_modules=["q_proj"])
    )
    for sampled in (model, lora):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            generate(sampled, [[1, 2, 3]], greedy(3), eos_ids=[], pad_id=PAD, seed=0)
        assert not [w for w in caught if "past_key_values" in str(w.message)]
    assert "cache" in declared or "past_key_values" in declared


def test_prompt_columns_pad_without_changing_the_responses(models):
    """A fixed ``prompt_columns`` (the run's one decode shape) only adds left padding."""
    model, prompts = models["qwen2"], ragged_prompts(14)
    free = generate(model, prompts, greedy(5), eos_ids=[], pad_id=PAD, seed=0)
    wide = generate(model, prompts, greedy(5), eos_ids=[], pad_id=PAD, seed=0, prompt_columns=40)
    assert wide.responses() == free.responses()
    np.testing.assert_allclose(wide.logprobs, free.logprobs, atol=ATOL)


@pytest.mark.slow
def test_compiled_decode_step_matches_eager_and_compiles_once(models):
    """``compile_mode="default"`` (about half a minute of inductor compilation on a CPU):
    the same tokens as eager, also after the weights change in place (as an optimizer
    step changes them), and at one ``prompt_columns`` one graph for every call, whatever
    its prompts' lengths."""
    from torch._dynamo.utils import counters

    model = models["qwen2"]
    weight = model.model.layers[0].mlp.down_proj.weight
    saved = weight.detach().clone()
    graphs = []
    try:
        for lengths in ((7, 3, 5, 1, 9), (2, 17, 4, 6, 1)):  # 16 and 32 columns unpadded
            prompts = ragged_prompts(13, lengths)
            eager = generate(model, prompts, greedy(6), eos_ids=[], pad_id=PAD, seed=0)
            out = generate(model, prompts, greedy(6), eos_ids=[], pad_id=PAD, seed=0,
                           compile_mode="default", prompt_columns=20)  # fmt: skip
            assert out.responses() == eager.responses()
            np.testing.assert_allclose(out.logprobs, eager.logprobs, atol=ATOL)
            graphs.append(counters["stats"]["unique_graphs"])
            with torch.no_grad():
                weight.mul_(-3.0)  # the next call must see it: the graph reads the weights
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert graphs[1] == graphs[0]


def test_a_failed_compile_warns_once_and_decodes_eagerly(models, monkeypatch, caplog):
    """A compiler backend that fails (as a machine without a C compiler or Triton would):
    the call still returns eager's tokens, and later calls do not try again."""
    import logging

    import strop.backends.torch.generate as sampler

    attempts = []

    def failing_backend(graph, example_inputs):
        attempts.append(graph)
        raise RuntimeError("no C compiler here")

    monkeypatch.setattr(sampler, "_FAILED_MODES", set())
    monkeypatch.setattr(
        sampler, "_compiled_forward",
        lambda mode: torch.compile(sampler._forward, backend=failing_backend),
    )  # fmt: skip
    model, prompts = models["qwen2"], ragged_prompts(15)
    eager = generate(model, prompts, greedy(5), eos_ids=[], pad_id=PAD, seed=0)
    with caplog.at_level(logging.WARNING, logger=sampler.__name__):
        for _ in range(2):
            out = generate(model, prompts, greedy(5), eos_ids=[], pad_id=PAD, seed=0,
                           compile_mode="default")  # fmt: skip
            assert out.responses() == eager.responses()
            np.testing.assert_allclose(out.logprobs, eager.logprobs, atol=ATOL)
    assert len(attempts) == 1
    (warning,) = [
        r.getMessage() for r in caplog.records if "torch.compile failed" in r.getMessage()
    ]
    assert "no C compiler here" in warning and "decoding eagerly" in warning


def test_generation_compile_setting_picks_the_decode_mode(models):
    """``generation.compile``: ``auto`` is eager on a CPU; a mode compiles at the run's
    prompt width; YAML's bare ``off`` (read as false) means off."""
    from strop.backends.torch.generate import sampler_keywords
    from strop.config import load_config
    from strop.generation import Decoding

    decoding = Decoding(seed=0, eos_ids=(2,), pad_id=PAD)
    model = models["qwen2"]

    def keywords(*overrides):
        config = load_config("tiny", ["backend=torch", *overrides])
        return sampler_keywords(config.generation, decoding, model, prompt_columns=24)

    assert keywords()["compile_mode"] is None and "prompt_columns" not in keywords()
    assert keywords("generation.compile=off")["compile_mode"] is None
    compiled = keywords("generation.compile=reduce-overhead")
    assert compiled["compile_mode"] == "reduce-overhead" and compiled["prompt_columns"] == 24


def _fsdp_worker(rank: int, model_dir: str, port: int) -> None:
    """One of two gloo ranks: FSDP2-sharded greedy generation equals the unsharded model's
    although the ranks stop after different numbers of steps, and training still works."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        reference, model = load(model_dir), load(model_dir)
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.train()
        prompts = ragged_prompts(20 + rank, lengths=(3, 8) if rank == 0 else (5, 20, 2))
        free = generate(reference, prompts, greedy(10), eos_ids=[], pad_id=PAD, seed=0)
        # Rank 0's rows stop after 3 and 2 steps, rank 1's run all 10.
        eos_ids = [int(free.tokens[0, 2]), int(free.tokens[1, 1])] if rank == 0 else []
        expected = generate(reference, prompts, greedy(10), eos_ids=eos_ids, pad_id=PAD, seed=0)
        out = generate(model, prompts, greedy(10), eos_ids=eos_ids, pad_id=PAD, seed=0)
        assert out.responses() == expected.responses()
        assert max(out.lengths) < 10 if rank == 0 else min(out.lengths) == 10
        assert model.training
        ids = torch.tensor([prompts[0]])
        model(ids, labels=ids).loss.backward()  # FSDP's buffers are not inference tensors
        # The weights are gathered once per call: no collective per decode step.
        assert collectives_per_call(model, prompts, 2) == collectives_per_call(model, prompts, 9)
        assert collectives_per_call(model, prompts, 2)["all_gather_single"] > 0
        import strop.backends.torch.generate as sampler

        sampler.unsharded = lambda model: contextlib.nullcontext()  # the check can fail:
        per_step = collectives_per_call(model, prompts, 9)  # gathers at every forward
        assert (
            per_step["all_gather_single"]
            > collectives_per_call(model, prompts, 2)["all_gather_single"]
        )
    finally:
        dist.destroy_process_group()


def collectives_per_call(model, prompts, new_tokens: int) -> collections.Counter:
    """The torch.distributed collectives one ``generate`` call runs on this rank."""
    import torch.distributed as dist

    counts: collections.Counter = collections.Counter()
    names = ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_reduce",
             "reduce_scatter_single", "reduce_scatter_tensor", "broadcast", "barrier")  # fmt: skip
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    try:
        for name in originals:
            setattr(dist, name, counting(name))
        generate(model, prompts, greedy(new_tokens), eos_ids=[], pad_id=PAD, seed=0)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return counts


@pytest.mark.slow
def test_fsdp2_sharded_model_over_two_processes(tiny_model_dir):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        _fsdp_worker, args=(tiny_model_dir("qwen2"), port), nprocs=2, start_method="spawn"
    )


@pytest.mark.parametrize("kind", ["qwen2", "llama3"])
def test_a_prompt_s_rollouts_prefill_it_once_and_sample_what_each_row_would(models, kind):
    """Rollouts of one prompt side by side (as the PPO loop asks) prefill each prompt once
    and copy its cache: the tokens and log-probabilities of prefilling every row."""
    import strop.backends.torch.generate as sampler

    prompts = [p for p in ragged_prompts(seed=3) for _ in range(3)]
    params = SamplingParams(max_new_tokens=10, temperature=1.0)

    def run(share: bool):
        rows = []  # of each forward: the prefill's, then each decode step's
        forward = sampler._forward

        def counted(model, cache, ids, *rest):
            rows.append(len(ids))
            return forward(model, cache, ids, *rest)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sampler, "_forward", counted)
            if not share:
                patch.setattr(sampler, "prompt_repeats", lambda prompts: 1)
            out = generate(models[kind], prompts, params, eos_ids=[], pad_id=PAD, seed=4)
        assert rows == [len(prompts) // (3 if share else 1)] + [len(prompts)] * 9
        return out

    shared, apart = run(share=True), run(share=False)
    np.testing.assert_array_equal(shared.tokens, apart.tokens)
    np.testing.assert_allclose(shared.logprobs, apart.logprobs, atol=1e-5)
    assert len({tuple(r) for r in shared.tokens.tolist()}) > len(prompts) // 3  # rows differ


@pytest.mark.parametrize("kind", ["qwen2", *FAMILY_KINDS])
def test_a_session_s_first_call_prefills_each_prompt_once_then_continues(tiny_model_dir, kind):
    """A KV-cache session's first call (episodes' openings, nothing cached) prefills a
    prompt's rollouts side by side once, as generate does, sampling generate's tokens; the
    next call continues from each row's copied cache and samples what re-prefilling does.
    Every family: the second call's rows run past every sliding window."""
    import strop.backends.torch.continuation as continuation
    from strop.agents.continuation import SlotAssignment
    from strop.generation import Decoding

    model = load(tiny_model_dir(kind))
    prompts = [p for p in ragged_prompts(seed=5) for _ in range(2)]
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    session = continuation.TorchContinuation(
        lambda: contextlib.nullcontext((model, {})), Decoding(0, (), PAD, None)
    )
    slots = list(range(len(prompts)))
    rows = []  # of each prefill
    forward = continuation._forward

    def counted(model, cache, ids, *rest):
        rows.append(len(ids))
        return forward(model, cache, ids, *rest)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(continuation, "_forward", counted)
        first = session.generate(prompts, params, 7, SlotAssignment(slots, [0] * len(slots)))
    assert rows == [len(prompts) // 2]
    expected = generate(model, prompts, params, eos_ids=[], pad_id=PAD, seed=7)
    np.testing.assert_array_equal(first.tokens, expected.tokens)
    np.testing.assert_allclose(first.logprobs, expected.logprobs, atol=1e-5)
    turns = [t[:n].tolist() for t, n in zip(first.tokens, first.lengths, strict=True)]
    follow = [p + t + [11, 12, 13] for p, t in zip(prompts, turns, strict=True)]
    cached = [len(p) + len(t) - 1 for p, t in zip(prompts, turns, strict=True)]
    second = session.generate(follow, params, 8, SlotAssignment(slots, cached))
    expected = generate(model, follow, params, eos_ids=[], pad_id=PAD, seed=8)
    np.testing.assert_array_equal(second.tokens, expected.tokens)
    np.testing.assert_allclose(second.logprobs, expected.logprobs, atol=1e-5)


def test_a_rows_sample_does_not_depend_on_the_batch_around_it(models):
    """A row's randomness is f(seed, step, prompt, sample index): the same prompt samples
    the same tokens alone at row 0 and at row 3 of a batch of 6 with other neighbours, and
    a prompt's second sample is the same wherever its two samples sit."""
    model = models["qwen2"]
    a, b, c, d = ragged_prompts(seed=8, lengths=(5, 3, 7, 4))
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95)

    def sample(prompts):
        return generate(model, prompts, params, eos_ids=[], pad_id=PAD, seed=21)

    alone = sample([a])
    among = sample([b, c, d, a, c, b])
    np.testing.assert_array_equal(among.tokens[3], alone.tokens[0])
    np.testing.assert_allclose(among.logprobs[3], alone.logprobs[0], atol=1e-5)
    pair = sample([a, a])  # side by side: one prefill
    apart = sample([b, a, c, a])
    np.testing.assert_array_equal(apart.tokens[[1, 3]], pair.tokens)
    assert (pair.tokens[0] != pair.tokens[1]).any()  # samples 0 and 1 differ


@pytest.mark.parametrize("top_k", [0, 5])
def test_nan_logits_sample_a_token_in_range(top_k):
    """A poisoned model's NaN logits still give a token of the vocabulary (the update they
    poison stops the run): the inverse CDF of a NaN distribution finds no index, and
    searchsorted's past-the-end answer indexed out of bounds."""
    from strop.backends.torch.sampling import sample_token as _sample

    logits = torch.full((3, 7), float("nan"))
    params = SamplingParams(max_new_tokens=1, temperature=1.0, top_k=top_k)
    token, _ = _sample(logits, params, torch.tensor([0.1, 0.5, 0.99], dtype=torch.float64))
    assert ((token >= 0) & (token < 7)).all(), token

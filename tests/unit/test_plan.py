"""strop plan: the arithmetic (Qwen2.5-7B's shapes), the command (table, --json, one-line
errors), and the plan against the live tensor bytes torch allocates on CPU (within 15%)."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from strop.cli import main
from strop.commands.plan import GIB, base_weight_bytes, plan_memory
from strop.config import load_config
from strop.io.model_spec import read_model_spec
from strop.io.run_identity import PolicyRun
from strop.models import parse_config
from strop.models.counts import parameter_count
from strop.objectives.roles import RolePlan

QWEN_7B = {
    "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "vocab_size": 152064, "tie_word_embeddings": False, "max_position_embeddings": 32768,
}  # fmt: skip
LORA_PPO_7B = [
    "backend=torch", "model.param_dtype=bfloat16", "lora.enabled=true", "lora.rank=32",
    "lora.alpha=64", "ppo.prompts_per_step=16", "ppo.num_generations_per_prompt=4",
    "ppo.mini_batch_size=16", "ppo.micro_batch_size=1", "data.max_length=256",
    "generation.max_new_tokens=256",
]  # fmt: skip


@pytest.fixture
def qwen_7b(tmp_path) -> Path:
    (tmp_path / "qwen7b").mkdir()
    (tmp_path / "qwen7b" / "config.json").write_text(json.dumps(QWEN_7B))
    return tmp_path / "qwen7b"


def run(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main(list(args))
    out, err = capsys.readouterr()
    return done.value.code or 0, out, err


def test_qwen_7b_counts():
    spec = parse_config(QWEN_7B)
    assert parameter_count(spec) == 7_615_616_512  # Qwen2.5-7B's published count
    assert base_weight_bytes(spec, "bfloat16") == 2 * 7_615_616_512
    nf4 = base_weight_bytes(spec, "bfloat16", "nf4")  # lora.base_quantization's hook
    assert 5.7e9 < nf4 < 6.0e9  # 6.53B layer weights at 4.5 bits + 1.09B embed + head at 2 B


def test_plan_command_7b_lora_ppo_table_json_and_device(capsys, qwen_7b):
    recipe = ["plan", "ppo-qwen2.5-1.5b-gsm8k", f"model.path={qwen_7b}", *LORA_PPO_7B]
    code, out, _ = run(capsys, *recipe, "--device-gib", "24")
    assert code == 0 and "LoRA adapter (critic)" in out and "fits" in out, out
    code, out, _ = run(capsys, *recipe, "--device-gib", "16", "--json")
    plan = json.loads(out)
    names = [p["name"] for p in plan["parts"]]
    assert names[:4] == ["base weights", "LoRA adapter (actor)", "LoRA adapter (critic)",
                         "value head"]  # fmt: skip
    assert "KV cache (rollouts)" in names and plan["fits"] is False
    assert 19 * GIB < plan["peak_bytes"] < 22 * GIB
    kv = next(p for p in plan["parts"] if p["name"] == "KV cache (rollouts)")
    assert kv["bytes"] == 64 * 511 * 28 * 2 * 4 * 128 * 2  # rows x slots x L x 2 x kv x d x c
    code, out, _ = run(capsys, *recipe, "generation.engine=vllm", "--device-gib", "80", "--json")
    vllm = next(p for p in json.loads(out)["parts"] if p["name"] == "vLLM engine")
    assert vllm["bytes"] == int(0.3 * 80 * GIB) and vllm["phase"] == "resident"


QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
}  # fmt: skip


def test_a_moe_plan_counts_every_parameter_and_the_active_ones(capsys, tmp_path):
    spec = parse_config(QWEN3_30B_A3B)
    assert parameter_count(spec) == 30_532_122_624  # Qwen3-30B-A3B's safetensors
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    code, out, _ = run(capsys, "plan", "tiny", f"model.path={tmp_path / 'moe'}", "--json")
    weights = json.loads(out)["parts"][0]
    assert code == 0 and weights["detail"].startswith("30.53B params (3.35B active) x "), weights


def test_a_dpo_recipe_plans_dpo_its_pairs_and_its_reference(capsys, qwen_7b):
    """Before: `strop plan` on a DPO recipe planned SFT (sft.micro_batch_size rows of
    data.max_length tokens, no reference) and refused --job dpo."""
    base = ["plan", "dpo-lora-qwen2.5-1.5b", f"model.path={qwen_7b}", "data.max_length=512",
            "dpo.micro_batch_size=2", "--device-gib", "80", "--json"]  # fmt: skip
    code, out, err = run(capsys, *base)
    plan = json.loads(out)
    assert code == 0 and plan["job"] == "dpo", err
    parts = {p["name"]: p for p in plan["parts"]}
    assert "N = 2 rows x 1024 tokens" in parts["activations"]["detail"]
    assert "reference weights" not in parts  # LoRA: the reference is the adapters off
    code, out, _ = run(capsys, *base, "lora.enabled=false", "dpo.reference=base")
    full = {p["name"]: p for p in json.loads(out)["parts"]}
    assert full["reference weights"]["bytes"] == full["base weights"]["bytes"]


def test_a_distillation_plans_its_teacher_and_the_jsd_its_chunks(capsys, qwen_7b, tmp_path):
    """strop plan counts the teacher (quantized as asked) beside the student, and the JSD's
    update holds both models' logits a chunk of tokens at a time, not whole."""
    student = tmp_path / "student"
    student.mkdir()
    small = {**QWEN_7B, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8}
    (student / "config.json").write_text(json.dumps(small))
    base = ["plan", "ppo-lora-tiny", *LORA_PPO_7B, f"model.path={student}",
            f"distill.teacher={qwen_7b}", "--job", "distill", "--json"]  # fmt: skip
    code, out, err = run(capsys, *base)
    parts = {p["name"]: p for p in json.loads(out)["parts"]}
    assert code == 0, err
    teacher = parse_config(QWEN_7B)
    assert parts["teacher weights"]["bytes"] == base_weight_bytes(teacher, "bfloat16")
    assert "loss chunk" not in parts
    _, out, _ = run(capsys, *base, "distill.teacher_quantization=nf4", "distill.loss=jsd")
    jsd = {p["name"]: p for p in json.loads(out)["parts"]}
    assert jsd["teacher weights"]["bytes"] == base_weight_bytes(teacher, "bfloat16", "nf4")
    assert jsd["loss chunk"]["bytes"] == 256 * QWEN_7B["vocab_size"] * 4 * 6
    assert jsd["activations"]["bytes"] < parts["activations"]["bytes"]  # no N x V logits


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["model.path=/nowhere/at/all"], "model.path=/nowhere/at/all: no such directory"),
        ([], "model.path is not set"),
        (["lora.rnak=3"], "lora.rnak"),
        (["--job", "kto"], "--job kto: strop plan knows sft, dpo, ppo, distill"),
    ],
)
def test_plan_bad_input_is_one_line_exit_2(capsys, args, says):
    code, _, err = run(capsys, "plan", "tiny", *args)
    assert code == 2 and says in err and err.count("\n") == 1, err


# measured on CPU ---------------------------------------------------------------------------

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parents[1]))
from memory_peak import LiveBytes  # noqa: E402
from tiny_models import save_tiny_model  # noqa: E402


def _model(tmp_path, h, layers, inter, vocab, heads=4, kv=2) -> Path:
    return save_tiny_model("qwen2", tmp_path / "m", hidden_size=h, num_hidden_layers=layers,
                           intermediate_size=inter, vocab_size=vocab, num_attention_heads=heads,
                           num_key_value_heads=kv)  # fmt: skip


def _live_bytes() -> LiveBytes:
    """A LiveBytes that starts from every tensor alive now: the weights, the adapters and
    the optimizer's moments (made by the step before)."""
    gc.collect()
    mode = LiveBytes()
    mode.track([o for o in gc.get_objects() if isinstance(o, torch.Tensor)])
    return mode


@pytest.mark.parametrize(
    ("shape", "rows", "length", "lora"),
    [((128, 2, 256, 1024), 4, 64, True), ((256, 3, 512, 2048), 2, 128, False)],
)
def test_sft_plan_within_15_percent_of_measured_peak(tmp_path, shape, rows, length, lora):
    from strop.backends import get_backend

    model = _model(tmp_path, *shape)
    config = load_config("tiny", [
        "backend=torch", f"model.path={model}", f"run_dir={tmp_path / 'run'}", "mesh.fsdp=1",
        f"lora.enabled={str(lora).lower()}", f"sft.micro_batch_size={rows}",
        f"sft.batch_size={rows}", f"data.max_length={length}",
    ])  # fmt: skip
    policy = get_backend("torch").build_policy(config, PolicyRun(total_steps=4))
    ids = np.random.default_rng(0).integers(0, shape[3], (rows, length)).astype(np.int32)
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids), "loss_mask": np.ones_like(ids)}
    policy.train_step(batch, 1)  # the optimizer's moments exist from here on
    mode = _live_bytes()
    with mode:
        policy.train_step(batch, 1)
    planned = plan_memory(config, "sft", read_model_spec(model)).peak_bytes
    print(f"plan {planned / 2**20:.2f} MiB, measured {mode.peak / 2**20:.2f} MiB")
    assert abs(planned / mode.peak - 1) < 0.15, (planned, mode.peak)


@pytest.mark.parametrize(("vocab", "prompts", "gens", "prompt", "new"),
                         [(1024, 4, 2, 32, 32), (4096, 4, 4, 16, 64)])  # fmt: skip
def test_ppo_plan_within_15_percent_of_measured_peak(tmp_path, vocab, prompts, gens, prompt, new):
    from strop.backends import get_backend
    from strop.generation import SamplingParams

    model, rows, width = _model(tmp_path, 128, 2, 256, vocab), prompts * gens, prompt + new
    config = load_config("ppo-lora-tiny", [
        "backend=torch", f"model.path={model}", f"run_dir={tmp_path / 'run'}", "mesh.fsdp=1",
        f"ppo.prompts_per_step={prompts}", f"ppo.num_generations_per_prompt={gens}",
        f"ppo.mini_batch_size={rows}", f"data.max_length={prompt}",
        f"generation.max_new_tokens={new}",
    ])  # fmt: skip
    actor_critic = get_backend("torch").build_actor_critic(
        config, total_updates=4, plan=RolePlan.from_config(config), checkpoints=None
    )
    actor_critic.expect_prompts(prompt)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (rows, width)).astype(np.int32)
    weights = np.zeros((rows, width), np.float32)
    weights[:, prompt:] = 1.0 / (rows * new)
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids), "loss_weights": weights,
             "old_values": np.zeros_like(weights), "returns": rng.standard_normal(ids.shape),
             "advantages": rng.standard_normal(ids.shape)}  # fmt: skip
    batch = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in batch.items()}

    def iteration():
        prompts_ids = [list(rng.integers(0, vocab, prompt)) for _ in range(prompts)]
        actor_critic.generate([p for p in prompts_ids for _ in range(gens)],
                              SamplingParams(max_new_tokens=new), seed=0,
                              eos_ids=[vocab + 1], pad_id=0)  # fmt: skip
        batch["old_logprobs"] = actor_critic.logprobs(batch)
        batch["ref_logprobs"] = actor_critic.logprobs(batch, reference=True)
        actor_critic.values(batch)
        actor_critic.train_critic(batch, 1)
        actor_critic.train_policy(batch, 1)

    iteration()  # both optimizers' moments exist from here on
    mode = _live_bytes()
    with mode:
        iteration()
    planned = plan_memory(config, "ppo", read_model_spec(model)).peak_bytes
    print(f"plan {planned / 2**20:.2f} MiB, measured {mode.peak / 2**20:.2f} MiB")
    assert abs(planned / mode.peak - 1) < 0.15, (planned, mode.peak)


@pytest.mark.parametrize(("shape", "length", "lora"), [((128, 2, 256, 1024), 64, True)])
def test_jax_sft_plan_within_15_percent_of_xla_buffers(tmp_path, shape, length, lora):
    """On JAX, what XLA allocates for the SFT update on one of the 8 CPU devices (weights
    replicated over mesh.data, 4 rows each): its compiled buffer assignment (arguments +
    outputs - donated + temporaries), as the CPU client keeps no allocator statistics."""
    pytest.importorskip("jax")
    from flax import nnx

    from strop.backends import get_backend
    from strop.backends.jax.train import put_micro_batches
    from strop.objectives.sft import SFT_BATCH, with_loss_weights

    model, rows = _model(tmp_path, *shape), 32
    overrides = ["backend=jax", f"model.path={model}", f"run_dir={tmp_path / 'run'}",
                 "mesh.fsdp=1", "mesh.data=-1", f"lora.enabled={str(lora).lower()}",
                 f"data.max_length={length}"]  # fmt: skip
    config = load_config("tiny", [*overrides, f"sft.micro_batch_size={rows}",
                                  f"sft.batch_size={rows}"])  # fmt: skip
    trainer = get_backend("jax").build_policy(config, PolicyRun(total_steps=4)).trainer
    ids = np.random.default_rng(0).integers(0, shape[3], (rows, length)).astype(np.int32)
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids), "loss_mask": np.ones_like(ids)}
    arrays = put_micro_batches(with_loss_weights(batch), SFT_BATCH, 1, trainer.mesh)
    _, params, frozen = nnx.split(trainer.model, trainer.trainable, ...)
    compiled = trainer._update.lower(params, trainer.opt_state, frozen, arrays).compile()
    stats = compiled.memory_analysis()
    measured = (stats.argument_size_in_bytes + stats.output_size_in_bytes
                - stats.alias_size_in_bytes + stats.temp_size_in_bytes)  # fmt: skip
    per_device = load_config("tiny", [*overrides, "sft.micro_batch_size=4", "sft.batch_size=4"])
    planned = plan_memory(per_device, "sft", read_model_spec(model)).peak_bytes
    print(f"plan {planned / 2**20:.2f} MiB, XLA {measured / 2**20:.2f} MiB")
    assert abs(planned / measured - 1) < 0.15, (planned, measured)

"""`strop plan`: the device memory a run will need, from its config and the model's
``config.json`` alone (no weight is read, neither jax nor torch is imported).

Parts (bytes; ``c`` the compute dtype's size, ``p`` the weights' storage dtype's):

- **base weights**: every parameter of the decoder at ``p``; the linears of its layers at
  the quantized size when ``lora.base_quantization`` says so (:func:`base_weight_bytes`).
  With routed experts the line also gives the parameters one token's forward uses.
  With LoRA one base serves every role (actor, critic, reference); without LoRA a PPO run
  holds one model per role (actor, an own critic, the reference copy).
- **adapters**: ``rank x (in + out)`` float32 numbers per targeted linear, per adapter of
  the role plan (actor, an own critic, an SFT reference adapter).
- **value head**: ``hidden + 1`` float32 numbers (PPO with a critic).
- **gradients**: one per trained number, at its dtype; **optimizer state**: AdamW keeps
  two moments per trained number at its dtype (float32 for adapters), SGD none.
- **activations** (training, one micro-batch of ``R`` rows of ``T`` tokens, ``N = R x T``):
  what autograd keeps for the backward pass, per layer and token, in elements of ``c``
  bytes; strop has no gradient checkpointing, so every layer's are alive at once::

      LoRA:  4 h + 2 q + 2 kv + 4 I + r x (LoRA linears of the layer)
      full:  6 h + 2 q + 2 kv + 4 I
      (+ 4 bytes x heads: the attention's log-sum-exp)

  with ``h`` hidden, ``q = heads x head_dim``, ``kv = kv_heads x head_dim``, ``I`` the
  MLP's width: the residual stream and the normed input of each of the two norms (full
  fine-tuning also keeps the norm's output before its weight), the attention's query,
  key, value and output (a fused kernel: no ``T x T`` scores), the MLP's gate, up, SiLU
  and product, and each adapter's ``A x`` (its input is already counted). Plus the
  logits: ``N x V x 12`` bytes (the float32 logits' log-softmax, its gradient and the
  logits' gradient; ``+ 2`` with bfloat16 compute: the logits before their float32
  copy); a PPO policy update ``N x V x 24`` bytes (its entropy, always computed for the
  ``entropy`` metric and the bonus, keeps three more). JAX (XLA's buffers):
  ``6h + 2q + 2kv + 7I`` per layer and token, the attention scores ``1.25 x N x T x
  heads x 4`` per layer (no fused kernel; PPO's packed rows are ``ppo.pack_width`` times
  as wide), logits ``16`` (SFT) / ``20`` (PPO) bytes. A PPO critic's update has no
  logits, so the policy's is the larger.
- **KV cache** (rollouts, native sampler): ``rows x (prompt + max_new_tokens) x layers x
  2 x kv_heads x head_dim x c`` with rows = ``ppo.prompts_per_step x
  num_generations_per_prompt`` (one generate call per iteration), prompt =
  ``data.max_length`` rounded up to 16; plus the prefill's transients: one layer's MLP
  and LoRA temporaries over the prompts (``prompts x prompt x 12 I x c``, a fit to what
  torch allocates on CPU) and the prompts' own cache before it is copied to their rows.
- **vLLM engine** (``generation.engine=vllm``): ``generation.vllm_memory_fraction`` of the
  device, held for the whole run (its own weights and KV cache; with ``vllm_sleep`` it is
  released while the trainer runs, so it counts in the rollout phase only).

The peak is the resident parts (weights, adapters, optimizer, an engine that never
sleeps) plus the largest of what comes and goes: the rollouts' KV cache (PPO samples,
then trains, never both at once), the activations (all alive when the backward starts)
and the gradients (all alive when it ends: the backward frees a layer's activations as it
makes its gradients; measured, full fine-tuning peaks at the activations alone). Validated
against the live tensor bytes torch allocates on CPU (tests/unit/test_plan_measured.py);
docs/plan.md has the figures.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal

from strop.errors import ConfigError
from strop.io.model_spec import read_model_spec, require_model_directory
from strop.lora_targets import match_targets
from strop.models import ModelSpec
from strop.models.counts import layer_linear_shapes, parameter_count, parameters_in_words
from strop.run.kinds import Logits, planned_kinds, run_kind

if TYPE_CHECKING:
    from strop.config import Config

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
ADAPTER_BYTES = 4  # adapters and the value head are float32 on both backends
# Bits per weight of a quantized linear, the scales included (bitsandbytes' defaults):
# nf4 = 4 bits + a float32 absmax per block of 64; int8 = 8 bits + a float32 scale per
# output row (added in base_weight_bytes). Embeddings, norms, biases and lm_head stay at
# the storage dtype. ``lora.base_quantization`` picks one.
QUANTIZED_BITS = {"nf4": 4 + 32 / 64, "int8": 8.0}

Phase = Literal["resident", "rollout", "forward", "backward"]
PHASES: tuple[Phase, ...] = ("resident", "rollout", "forward", "backward")


@dataclass(frozen=True)
class Part:
    """One line of the plan: what it is, its bytes, when it is alive, how it was counted."""

    name: str
    bytes: int
    phase: Phase
    detail: str


@dataclass(frozen=True)
class MemoryPlan:
    """A job's expected device memory, part by part, and the device it is compared with."""

    job: str
    parts: tuple[Part, ...]
    device_bytes: int | None
    device_source: str

    def phase_bytes(self, phase: Phase) -> int:
        return sum(part.bytes for part in self.parts if part.phase == phase)

    @property
    def peak_bytes(self) -> int:
        """Resident parts plus the largest of what comes and goes: the rollouts' KV cache,
        the activations at the end of a forward, the gradients at the end of a backward."""
        passing = (self.phase_bytes(p) for p in ("rollout", "forward", "backward"))
        return self.phase_bytes("resident") + max(passing)

    @property
    def fits(self) -> bool | None:
        return None if self.device_bytes is None else self.peak_bytes <= self.device_bytes

    def to_dict(self) -> dict:
        return {
            "job": self.job,
            "parts": [asdict(part) for part in self.parts],
            "phases": {p: self.phase_bytes(p) for p in PHASES},
            "peak_bytes": self.peak_bytes,
            "device_bytes": self.device_bytes,
            "device_source": self.device_source,
            "fits": self.fits,
        }


# shapes ------------------------------------------------------------------------------------


def base_weight_bytes(spec: ModelSpec, param_dtype: str, quantization: str = "none") -> int:
    """The base model's bytes: every parameter at ``param_dtype``, or, quantized
    (``nf4``/``int8``), the layers' linear weights at :data:`QUANTIZED_BITS` (int8: plus a
    float32 scale per output row) and the rest at ``param_dtype``."""
    full = parameter_count(spec) * DTYPE_BYTES[param_dtype]
    if quantization == "none":
        return full
    if quantization not in QUANTIZED_BITS:
        raise ConfigError(f"lora.base_quantization={quantization!r}: strop plan knows none, "
                          f"{', '.join(QUANTIZED_BITS)}")  # fmt: skip
    shapes = layer_linear_shapes(spec)
    weights = sum(out * inp for out, inp in shapes)
    quantized = weights * QUANTIZED_BITS[quantization] / 8
    if quantization == "int8":
        quantized += sum(out for out, _ in shapes) * 4
    return int(full - weights * DTYPE_BYTES[param_dtype] + quantized)


def adapter_numbers(spec: ModelSpec, patterns: list[str], rank: int) -> tuple[int, list[str]]:
    """LoRA numbers of one adapter (``rank x (in + out)`` per targeted linear) and the
    targeted paths; a pattern matching no linear is the ConfigError training gives."""
    targets = match_targets(patterns, spec.linear_paths())
    numbers = 0
    for path in targets:
        out, inp = spec.linear_shape(path)
        numbers += rank * (inp + out)
    return numbers, targets


def _adapted_per_layer(targets: list[str], spec: ModelSpec) -> int:
    """How many linears of one layer carry an adapter (the mean over layers)."""
    layered = [t for t in targets if re.match(r"model\.layers\.\d+\.", t)]
    return round(len(layered) / spec.num_layers)


def activation_bytes(
    spec: ModelSpec,
    *,
    backend: str,
    rows: int,
    length: int,
    compute_dtype: str,
    lora_rank: int | None,
    lora_linears: int,
    logits: int,
    lm_head_trained: bool = False,
    attention_width: float | None = None,
) -> tuple[int, str]:
    """What the backward keeps of one micro-batch of ``rows x length`` tokens (the module's
    docstring), and the formula as text."""
    c, tokens = DTYPE_BYTES[compute_dtype], rows * length
    h, inter = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    mlp = 7 if backend == "jax" else 4  # XLA keeps the MLP's and LoRA's sums too
    norms = 6 if lora_rank is None or backend == "jax" else 4
    per_token = norms * h + 2 * q + 2 * kv + mlp * inter
    formula = f"{norms}h + 2q + 2kv + {mlp}I"
    if lora_rank is not None:
        per_token += lora_linears * lora_rank
        formula += f" + {lora_linears}r"
    size = tokens * spec.num_layers * (per_token * c + 4 * spec.num_heads)
    text = f"N x L x ({formula}) x {c} B"
    if backend == "jax":  # no fused kernel: the scores' softmax, float32, per layer
        width = attention_width or length  # ppo.pack: rows pack_width times as wide
        size += int(1.25 * tokens * width * spec.num_heads * 4 * spec.num_layers)
        text += f" + 1.25 N x {width:g} x heads x L x 4 B (scores)"
    if logits:
        per_vocab = logits + (2 if c == 2 else 0)
        size += tokens * spec.vocab_size * per_vocab
        text += f" + N x V x {per_vocab} B (logits)"
        if lm_head_trained:
            size += tokens * h * 3 * c
    return size, text


def kv_cache_bytes(spec: ModelSpec, *, rows: int, length: int, compute_dtype: str) -> int:
    """rows x length x layers x 2 x kv_heads x head_dim x c."""
    per_slot = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim
    return rows * length * per_slot * DTYPE_BYTES[compute_dtype]


# Bytes per token and vocabulary entry that the loss keeps of the logits (float32): SFT's
# log-softmax, its gradient and the logits' gradient; a PPO policy update's entropy adds
# more (torch keeps three more copies; XLA fuses some). Read off CPU measurements.
_LOGITS_BYTES: dict[tuple[str, Logits], int] = {
    ("torch", "token_logprobs"): 12, ("torch", "policy_gradient"): 24,
    ("jax", "token_logprobs"): 16, ("jax", "policy_gradient"): 20,
    ("torch", "chunked"): 0, ("jax", "chunked"): 0,  # Footprint.chunk's part instead
}  # fmt: skip
_CHUNK_ARRAYS = 6  # [chunk, V] float32 arrays of one JSD chunk: both models' logits and
# log-probabilities, the mixture, the gradient (backends/*/distill.py)


def _round_up(n: int, multiple: int = 16) -> int:
    return -(-n // multiple) * multiple  # the samplers' prompt buckets (PROMPT_BUCKET)


# the plan -----------------------------------------------------------------------------------


def plan_memory(
    config: Config,
    job: str,
    spec: ModelSpec,
    *,
    device_bytes: int | None = None,
    device_source: str = "unknown",
) -> MemoryPlan:
    """The parts of a run of kind ``job`` (``sft``, ``dpo``, ``ppo``...) under ``config``
    for ``spec``'s model: the weights, the adapters, the optimizer and gradients, and what
    the kind's :class:`~strop.run.kinds.Footprint` says it holds beside them (its rows
    and length, a frozen copy of the weights, a reference adapter, the rollouts)."""
    kind = run_kind(job)
    if kind.footprint is None:
        raise ConfigError(f"strop plan does not plan strop {kind.name}")
    param, compute = config.model.param_dtype, config.model.dtype
    p = DTYPE_BYTES[param]
    lora = config.lora
    quantization = lora.base_quantization if lora.enabled else "none"
    base = base_weight_bytes(spec, param, quantization)
    roles = kind.roles(config)
    footprint = kind.footprint(config, roles)
    parts: list[Part] = []

    def add(name: str, size: float, phase: Phase, detail: str) -> None:
        parts.append(Part(name, int(size), phase, detail))

    weights = f"{parameters_in_words(spec)} x {p} B ({param})"
    if quantization != "none":
        weights = f"{parameters_in_words(spec)}, layer linears {quantization}"
    if lora.enabled or roles is None:
        add("base weights", base, "resident", weights + (", shared by every role" * bool(roles)))
    else:
        for model in roles.models:
            add(f"{model} weights", base, "resident", weights)
    if footprint.frozen_copy is not None and not lora.enabled:
        add("reference weights", base, "resident", f"{weights}, {footprint.frozen_copy}")
    for name, path, frozen_quantization in footprint.frozen_models:  # a teacher
        frozen = read_model_spec(path)
        detail = f"{parameters_in_words(frozen)} x {p} B ({param}), frozen ({path})"
        if frozen_quantization != "none":
            detail = f"{parameters_in_words(frozen)}, layer linears {frozen_quantization}, frozen"
        add(f"{name} weights", base_weight_bytes(frozen, param, frozen_quantization), "resident",
            detail)  # fmt: skip

    trained = 0  # bytes of trained numbers: gradients and the optimizer's moments follow
    if lora.enabled:
        numbers, targets = adapter_numbers(spec, lora.target_modules, lora.rank)
        adapters = footprint.adapters
        detail = f"r={lora.rank} on {len(targets)} linears: {numbers / 1e6:.1f}M x 4 B"
        for name in adapters:
            add(f"LoRA adapter ({name})", numbers * ADAPTER_BYTES, "resident", detail)
        trained_adapters = [a for a in adapters if a != "reference"]
        trained = numbers * ADAPTER_BYTES * len(trained_adapters)
        per_update = numbers * ADAPTER_BYTES
        per_layer, head_trained = _adapted_per_layer(targets, spec), "lm_head" in targets
    else:
        own_critic = roles is not None and roles.own_critic
        trained = base * (2 if own_critic else 1)
        per_update = base
        per_layer, head_trained = 0, True
    if roles is not None and roles.has_critic:
        head = (spec.hidden_size + 1) * ADAPTER_BYTES
        add("value head", head, "resident", f"(hidden + 1) x 4 B ({roles.critic})")
        trained += head
        per_update += head
    moments = 2 if config.optim.name == "adamw" else 0
    add("optimizer state", moments * trained, "resident",
        f"{config.optim.name}: {moments} moments x trained bytes")  # fmt: skip
    add("gradients", per_update, "backward",
        "one per number one update trains, at its dtype (the critic's and the actor's "
        "updates take turns)" if roles is not None and roles.own_critic
        else "one per trained number, at its dtype")  # fmt: skip

    rows, length = footprint.rows, footprint.length
    acts, formula = activation_bytes(
        spec,
        backend=config.backend,
        rows=rows,
        length=length,
        compute_dtype=compute,
        lora_rank=lora.rank if lora.enabled else None,
        lora_linears=per_layer,
        logits=_LOGITS_BYTES[config.backend, footprint.logits],
        attention_width=length * (config.ppo.pack_width if roles and config.ppo.pack else 1),
        lm_head_trained=head_trained and not lora.enabled,
    )
    add("activations", acts, "forward", f"N = {rows} rows x {length} tokens; {formula}")
    if footprint.chunk is not None:
        add("loss chunk", footprint.chunk * spec.vocab_size * 4 * _CHUNK_ARRAYS, "backward",
            f"{footprint.chunk} tokens x V x 4 B x {_CHUNK_ARRAYS} (both models' logits, "
            "their log-probabilities, the mixture, the gradient)")  # fmt: skip
    if footprint.rollouts:
        _rollout_parts(config, spec, add, device_bytes, length)
    return MemoryPlan(job, tuple(parts), device_bytes, device_source)


def _rollout_parts(config, spec, add, device_bytes, length) -> None:
    """PPO's rollout phase: the native sampler's KV cache, or the vLLM engine's share."""
    gen = config.generation
    rows = config.ppo.rollouts_per_step
    if gen.engine == "vllm":
        fraction = gen.vllm_memory_fraction
        phase: Phase = "rollout" if gen.vllm_sleep else "resident"
        if device_bytes is None:
            add("vLLM engine", 0, phase, f"{fraction:.0%} of the device (unknown: --device-gib)")
        else:
            add("vLLM engine", fraction * device_bytes, phase,
                f"generation.vllm_memory_fraction={fraction} of the device "
                f"(its weights and KV cache){', asleep while training' * gen.vllm_sleep}")  # fmt: skip
        return
    c = DTYPE_BYTES[config.model.dtype]
    width = _round_up(length - gen.max_new_tokens)  # the sampler's prompt columns
    slots = width + gen.max_new_tokens - 1
    cache = kv_cache_bytes(spec, rows=rows, length=slots, compute_dtype=config.model.dtype)
    add("KV cache (rollouts)", cache, "rollout",
        f"{rows} rows x {slots} slots x {spec.num_layers} layers x 2 x {spec.num_kv_heads} "
        f"kv heads x {spec.head_dim} x {c} B")  # fmt: skip
    prompts = config.ppo.prompts_per_step  # a prompt's rollouts prefill it once
    prefill = prompts * width * 12 * spec.intermediate_size * c
    if config.ppo.num_generations_per_prompt > 1:  # its cache, copied to the rollouts' rows
        prefill += kv_cache_bytes(
            spec, rows=prompts, length=slots, compute_dtype=config.model.dtype
        )
    add(
        "prefill (rollouts)",
        prefill,
        "rollout",
        f"{prompts} prompts x {width} tokens x 12 I x {c} B (one layer's MLP), + their "
        "cache before its copy to the rollouts' rows",
    )


def plan_for(
    config: Config, job: str, *, device_bytes: int | None, device_source: str
) -> MemoryPlan:
    """`strop plan`'s: ``job`` (``auto``: ppo or dpo when the recipe sets that section, else
    sft) for ``model.path``'s config.json; one-line errors for a missing model or job."""
    planned = [kind.name for kind in planned_kinds()]
    if job == "auto":  # the last planned kind whose section the recipe sets, else the first
        job = next((n for n in reversed(planned[1:]) if n in config.model_fields_set), planned[0])
    if job not in planned:
        raise ConfigError(f"--job {job}: strop plan knows {', '.join(planned)} (or auto)")
    if config.model.path is None:
        raise ConfigError("model.path is not set: strop plan reads its config.json")
    require_model_directory(config.model.path, "model.path")
    spec = read_model_spec(config.model.path)
    return plan_memory(config, job, spec, device_bytes=device_bytes, device_source=device_source)


def device_memory() -> tuple[int | None, str]:
    """The first visible GPU's memory from nvidia-smi (no framework starts), or
    (None, why)."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
        return int(float(done.stdout.split()[0]) * (1 << 20)), "nvidia-smi (GPU 0)"
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None, "no GPU seen"

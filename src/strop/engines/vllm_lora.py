"""A LoRA adapter handed to a vLLM engine from memory (``generation.vllm_sync=adapter``).

vLLM 0.32 loads an adapter only from a path: ``LoRARequest`` carries ``lora_path`` and
no tensors, and the worker's ``WorkerLoRAManager._load_adapter`` reads
``adapter_config.json`` and ``adapter_model.safetensors`` there, then builds the adapter
with ``LoRAModel.from_lora_tensors``. What is written around it, in the worker (reached
with ``LLM.collective_rpc`` and a function, which vLLM runs on each worker object; strop's
engine runs in this process):

- the worker's LoRA manager gets, once, its own ``_load_adapter``: for an adapter id that
  strop has handed tensors for, it builds the adapter from them with vLLM's
  ``LoRAModel.from_lora_tensors`` and ``PEFTHelper.from_dict``, after the checks vLLM's
  own loader makes (the rank against ``max_lora_rank``, no module vLLM cannot serve);
  any other id goes to vLLM's loader as before;
- the adapter is then added through vLLM's own ``add_lora`` (its cache, eviction and
  activation unchanged), and the tensors are dropped.

The ``LoRARequest`` the engine samples with names a path that does not exist
(:data:`IN_MEMORY`): vLLM never reads it, because the adapter is already loaded when the
request is scheduled (an id in the manager's cache is only touched), and ``max_loras=1``
with the previous id removed leaves nothing to evict it.
"""

from __future__ import annotations

from typing import Any

IN_MEMORY = "strop-in-memory://"
"""The ``lora_path`` prefix of adapters strop hands over in memory (never read)."""


def install_adapter(
    worker: Any, request: Any, tensors: dict[str, Any], config: dict[str, Any]
) -> bool:
    """Run on a vLLM worker (``collective_rpc``): load ``request``'s adapter from PEFT-named
    ``tensors`` (torch, CPU) and its ``adapter_config.json`` as a dict, ``config``."""
    manager = worker.model_runner.lora_manager
    pending = getattr(manager, "_strop_pending", None)
    if pending is None:  # first adapter: route in-memory ids to _from_memory
        pending = manager._strop_pending = {}
        vllm_load = manager._load_adapter

        def load(lora_request: Any) -> Any:
            held = pending.get(lora_request.lora_int_id)
            if held is None:
                return vllm_load(lora_request)
            return _from_memory(manager, lora_request, *held)

        manager._load_adapter = load
    pending[request.lora_int_id] = (tensors, config)
    try:
        return worker.add_lora(request)
    finally:
        del pending[request.lora_int_id]


def _from_memory(
    manager: Any, request: Any, tensors: dict[str, Any], config: dict[str, Any]
) -> Any:
    """``WorkerLoRAManager._load_adapter`` for tensors in memory: vLLM's own steps, less
    the reading of files."""
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

    helper = PEFTHelper.from_dict(
        {**config, "vllm_max_position_embeddings": manager.max_position_embeddings}
    )
    helper.validate_legal(manager.lora_config)
    adapters = manager._adapter_manager
    model = adapters.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = mapper.get_rename_mapper()
    expected = set()
    for module in adapters.supported_lora_modules:
        expected.update(adapters.packed_modules_mapping.get(module, [module]))
    unexpected = sorted(
        {
            module
            for name in tensors
            if not is_base_embedding_weights(name)
            for module, _ in [parse_fine_tuned_lora_name(name, mapper)]
            if module.rsplit(".", 1)[-1] not in expected
        }
    )
    if unexpected:  # as vLLM's from_local_checkpoint refuses them
        raise ValueError(
            f"adapter {request.lora_name}: vLLM serves LoRA on {sorted(expected)}, not on "
            f"{unexpected[:4]}"
        )
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=request.lora_int_id,
        tensors=tensors,
        peft_helper=helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    adapters._validate_modules_to_save(lora)
    return lora

"""A frozen reward model on the torch backend: ``transformers``'
``...ForSequenceClassification``, FSDP2-sharded under ``torchrun``.

Built like the policy (:mod:`strop.backends.torch.model`): on the meta device, checked
against the checkpoint's headers, sharded (``fully_shard`` per decoder layer, then the
root) when launched distributed, then filled one tensor at a time. Eval mode, no
gradients, no optimizer. The PPO loop scores every row on every rank; distributed, each
rank scores its own share of the rows (padded to equal shares, so every rank runs the
same forwards) and the scores are all-gathered. The score head's output at every column
is read with a forward hook and pooled as :mod:`strop.batch.reward_rows` says (transformers'
rule: the last token that is not ``pad_token_id``).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import transformers

from strop.backends.torch.fsdp import (
    TORCH_DTYPES,
    all_gather_rows,
    copy_full_into,
    place,
    shard_model,
)
from strop.backends.torch.model import (
    _to_torch,
    allocate,
    on_meta,
    positions_from_mask,
)
from strop.batch.reward_rows import encode_pairs, pooled_index, right_padded
from strop.data import Tokenizer
from strop.errors import ModelError
from strop.io.experts import StackedExpertsReader
from strop.io.hf import check_tensors, open_checkpoint


class TorchRewardModel:
    """:class:`~strop.backends.base.RewardModel` with transformers."""

    backend = "torch"

    def __init__(self, config, path: str | os.PathLike):
        path = os.fspath(path)
        self.placement = place(config.mesh)
        self.tokenizer = Tokenizer.from_pretrained(path)
        spec, reader = open_checkpoint(path)
        try:
            hf_config = transformers.AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as err:
            raise ModelError(f"{path}: transformers cannot read config.json ({err})") from None
        self.pad_id = hf_config.pad_token_id
        if self.pad_id is None:  # pooled here; transformers refuses batches without one
            hf_config.pad_token_id = -1
        self.compute_dtype = TORCH_DTYPES[config.model.dtype]
        model = on_meta(
            lambda: transformers.AutoModelForSequenceClassification.from_config(
                hf_config, dtype=TORCH_DTYPES[config.model.param_dtype]
            )
        )
        expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
        reader = StackedExpertsReader(reader, expected)
        check_tensors(reader, expected, tied=spec.tie_word_embeddings)
        if self.placement.distributed:
            shard_model(model, self.placement.mesh, self.compute_dtype)
        allocate(model, self.placement.device)
        for name, param in dict(model.named_parameters()).items():
            copy_full_into(param, _to_torch(reader.get(name)))
        self.model = model.eval().requires_grad_(False)
        self.rows = max(1, config.ppo.rows_per_micro_batch)
        self._columns: list[torch.Tensor] = []
        self.model.score.register_forward_hook(lambda m, i, out: self._columns.append(out))

    @torch.no_grad()
    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        """``[len(rows)]`` float32 scores (every rank calls this equally often)."""
        width = max((len(r) for r in rows), default=1) or 1
        ids, mask = right_padded(rows, width, max(len(rows), 1))
        device = self.placement.device
        ids_t = torch.from_numpy(ids).long().to(device)
        mask_t = torch.from_numpy(mask).long().to(device)
        index = [pooled_index(r, self.pad_id) for r in rows] or [0]
        stored = next(self.model.parameters()).dtype
        autocast = not self.placement.distributed and stored != self.compute_dtype
        self._columns.clear()
        with torch.autocast(device.type, dtype=self.compute_dtype, enabled=autocast):
            self.model(input_ids=ids_t, attention_mask=mask_t,
                       position_ids=positions_from_mask(mask_t), use_cache=False)  # fmt: skip
        columns = self._columns.pop()[..., 0].float()  # [B, L]: the head at every column
        picked = columns[torch.arange(len(index)), torch.tensor(index, device=device)]
        return picked[: len(rows)]

    def score_ids(self, rows: list[list[int]]) -> np.ndarray:
        n, world = len(rows), self.placement.world_size
        share = -(-n // world)
        mine = rows[self.placement.rank * share : (self.placement.rank + 1) * share]
        mine = mine + [[0]] * (share - len(mine))  # equal shares: the same forwards per rank
        parts = [self._forward(mine[b : b + self.rows]) for b in range(0, share, self.rows)]
        local = torch.cat(parts) if parts else torch.zeros(0, device=self.placement.device)
        if self.placement.distributed:  # FSDP2 keeps the root's weights gathered after a forward
            self.model.reshard()
        return all_gather_rows(local, self.placement)[:n].cpu().numpy().astype(np.float32)

    def score(self, prompts: list[str], completions: list[str]) -> np.ndarray:
        if not completions:
            return np.zeros(0, np.float32)
        return self.score_ids(encode_pairs(self.tokenizer, prompts, completions))


build_reward_model = TorchRewardModel

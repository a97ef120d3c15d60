"""Which modules get LoRA adapters: one rule for both backends, the same as PEFT's.

Targets are regexes matched with ``re.fullmatch`` against HF-style dotted module paths
(``model.layers.0.self_attn.q_proj``, ``lm_head``): the strings PEFT matches when its
``target_modules`` is one regex. A pattern that matches nothing is an error, not a
silently untrained model.
"""

from __future__ import annotations

import re

from strop.errors import ConfigError


def match_targets(patterns: list[str], paths: list[str]) -> list[str]:
    """Paths matched (``re.fullmatch``) by any pattern; a pattern matching none is an error."""
    matched = set()
    for pattern in patterns:
        hits = {path for path in paths if re.fullmatch(pattern, path)}
        if not hits:
            shown = ", ".join(paths[:12]) + (", ..." if len(paths) > 12 else "")
            raise ConfigError(
                f"lora.target_modules: pattern {pattern!r} matches no module "
                f"(re.fullmatch against module paths such as: {shown})"
            )
        matched |= hits
    return [path for path in paths if path in matched]

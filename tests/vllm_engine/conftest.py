"""vLLM's tests run in their own virtualenv: ``make test`` builds ``.venv-vllm`` (vllm-cpu
pins an older ``transformers`` than strop's main environment) and runs this folder there.
Where vLLM is not installed (the main environment) the folder is not collected."""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: a few tiny engines per session

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]

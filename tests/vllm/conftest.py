"""vLLM tests run in their own virtualenv (``make test`` builds ``.venv-vllm``: vLLM pins
an older ``transformers`` than strop's main environment); elsewhere they are skipped."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: a few tiny engines per session

vllm = pytest.importorskip("vllm", reason="vLLM runs in .venv-vllm (make test-vllm)")

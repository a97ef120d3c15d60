"""Multi-turn agents: environments, tools, the python sandbox, and token-in/token-out episodes.

The sources of environments beyond the built-ins and ``module:factory`` references register
here (:func:`~strop.agents.environment.register_source`), each imported only when named, as
the rollout engines register in :mod:`strop.engines`: ``verifiers:<module>`` plays a
``verifiers`` 0.4 taskset (:mod:`strop.agents.verifiers_env`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from strop.agents.environment import register_source


def _verifiers(reference: str, module: str) -> Callable[..., Any]:
    from strop.agents.verifiers_env import verifiers_factory

    return verifiers_factory(reference, module)


register_source("verifiers", _verifiers)

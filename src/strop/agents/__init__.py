"""Multi-turn agents: environments, tools, the python sandbox, and token-in/token-out episodes.

The sources of environments beyond the built-ins and ``module:factory`` references register
here (:func:`~strop.agents.environment.register_source`), each imported only when named, as
the rollout engines register in :mod:`strop.engines`: ``verifiers:<module>`` plays a
``verifiers`` 0.4 taskset (:mod:`strop.agents.verifiers_env`). So do the adapters of other
frameworks' environment shapes (:func:`~strop.agents.environment.register_adapter`), each
imported only when a factory makes something that is not strop's: TRL's
``environment_factory`` environments (:mod:`strop.agents.trl_env`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from strop.agents.environment import register_adapter, register_source


def _verifiers(reference: str, module: str) -> Callable[..., Any]:
    from strop.agents.verifiers_env import verifiers_factory

    return verifiers_factory(reference, module)


register_source("verifiers", _verifiers)


def _trl(made: Any) -> Any:
    from strop.agents.trl_env import trl_environment

    return trl_environment(made)


register_adapter(_trl)

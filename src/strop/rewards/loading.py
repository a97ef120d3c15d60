"""Where a reward comes from: a registered name, ``package.module:function`` or
``path/to/file.py:function``.

:func:`load` turns one such reference into a :class:`~strop.rewards.base.Reward`:

* a name without ``:`` is looked up in the registry (``gsm8k``, ``math``, ``format`` and
  anything :func:`~strop.rewards.register`\\ ed);
* ``package.module:function`` imports the module from the Python path (an installed
  package, or a directory on ``PYTHONPATH``) and takes the attribute;
* ``path/to/file.py:function`` (anything ending in ``.py`` or holding a ``/``) runs that
  file as a module, a path relative to the current directory or absolute. A file is run
  once per process, however often it is named;
* ``model:DIR`` is a reward model (:mod:`strop.rewards.model`): ``DIR`` is checked here,
  the model is built by the run's backend (``config``) when it first scores.

(The imports, and their messages, are :mod:`strop.references`'s, shared with your own
policy loss.)

Every way this can fail (no such file or module, the import raised, no such attribute,
not callable, a class) raises :class:`~strop.rewards.base.RewardError`: one line that names
the setting, the reference and what to do. A function is named after its attribute
(``my_rewards.py:exact`` is ``exact``); it has no gold rule
(:class:`~strop.rewards.base.Gold`), so its data is never refused for lack of a gold answer.
With a deadline in ``limits`` (:class:`~strop.rewards.base.RewardLimits`) such a function
is called in a worker process that imports it again by its reference (a file by its
absolute path; :mod:`strop.rewards.isolated`); it is still imported here first, so that
every mistake above is found before anything loads.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from strop.errors import ConfigError
from strop.references import BadReference, import_function, is_reference, split
from strop.rewards.base import Reward, RewardError, RewardLimits, get, names
from strop.rewards.calling import one_line
from strop.rewards.model import NAME, PREFIX, ModelReward, check_directory, is_model_reference


def load(
    ref: str,
    *,
    setting: str = "reward",
    build_model: Callable[[Path], Any] | None = None,
    limits: RewardLimits | None = None,
) -> Reward:
    """A new :class:`Reward` (fresh counters) for ``ref``; ``setting`` (``ppo.reward``) is
    named in messages; ``build_model``: how the run builds a reward model (``model:DIR``)
    from its directory, at its first call; ``limits``: the run's (a function from a reference is called in a worker process
    when they set a deadline). Raises :class:`RewardError` (a :class:`ConfigError`)."""
    if is_model_reference(ref):
        directory = check_directory(ref.removeprefix(PREFIX), ref, setting)
        model = ModelReward(directory, ref, setting, build_model)
        return Reward(NAME, model, source=ref, limits=limits)
    if not is_reference(ref):
        try:
            return get(ref, limits)
        except ConfigError:
            hint = (
                f"; give the function too: {ref}:FUNCTION"
                if ref.endswith(".py")
                else "; or give package.module:function or path/to/file.py:function"
            )
            raise RewardError(
                f"{setting}={ref!r}: unknown reward; the registered ones are "
                f"{', '.join(names())}{hint}"
            ) from None
    parts = split(ref)
    if parts is None:
        raise RewardError(
            f"{setting}={ref!r}: expected a registered name, package.module:function or "
            "path/to/file.py:function"
        )
    target, attr = parts
    try:
        found = import_function(
            target,
            attr,
            namespace="_strop_reward_",
            describe=one_line,
            hint="; expected package.module:function or path/to/file.py:function",
        )
    except BadReference as exc:
        raise RewardError(f"{setting}={ref!r}: {exc}") from None
    if inspect.isclass(found.function):
        where = found.where
        raise RewardError(
            f"{setting}={ref!r}: {attr!r} in {where} is a class; name a function, or an "
            f"instance made in {where} (e.g. {attr.lower()} = {attr}())"
        )
    importable = ref if found.path is None else f"{found.path}:{attr}"
    return Reward(attr, found.function, source=ref, limits=limits, importable=importable)

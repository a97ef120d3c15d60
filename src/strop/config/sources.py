"""Where configuration values come from, so that errors can say so.

Reads YAML recipes and their ``base:`` chains, applies dotted ``key=value`` overrides,
records for every dotted key the source that set it last (a recipe file, an override, or
nothing: the default), and turns pydantic validation errors into one-line messages that
name the key, the value and that source. Generic over the schema: :mod:`strop.config`
passes its root model in. A ``base:`` path is relative to the recipe naming it; the
values a recipe sets (``model.path``, ``data.train_path``, ...) are kept as written, so
their paths are relative to the working directory, as on the command line.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from strop.errors import ConfigError

Provenance = dict[str, str]
"""Dotted key -> label of the source that set it last (a file path or ``override '...'``)."""

RECIPES_DIR: Traversable = resources.files("strop").joinpath("recipes")
RUN_CONFIG_FILE = "config.yaml"
"""What a run directory records of the config its run started with (strop.io.run_record);
a run directory named as a recipe is that file."""
_MAX_ERRORS = 3


def builtin_recipes() -> list[str]:
    """Names of the recipes shipped in ``strop/recipes`` (usable without a path)."""
    return sorted(
        f.name.removesuffix(".yaml") for f in RECIPES_DIR.iterdir() if f.name.endswith(".yaml")
    )


def recipe_summary(name: str) -> str:
    """The one-line summary of built-in recipe ``name``: its first line, a comment."""
    first = RECIPES_DIR.joinpath(f"{name}.yaml").read_text(encoding="utf-8").partition("\n")[0]
    return first.removeprefix("#").strip() if first.startswith("#") else ""


@dataclass(frozen=True)
class _Recipe:
    """A recipe file and the name messages give it."""

    file: Traversable
    label: str
    builtin: bool

    def identity(self) -> str:
        return self.label if self.builtin else str(Path(str(self.file)).resolve())


def _find(name: str, parent: _Recipe | None) -> _Recipe | None:
    """The recipe ``name`` refers to: a file (relative to ``parent``'s folder) or a built-in."""
    if parent is None or not parent.builtin:
        path = Path(name)
        if parent is not None and not path.is_absolute():
            path = Path(str(parent.file)).parent / path
        if path.is_file():
            return _Recipe(path, str(path), builtin=False)
    file_name = name if name.endswith(".yaml") else f"{name}.yaml"
    if Path(file_name).name == file_name and RECIPES_DIR.joinpath(file_name).is_file():
        return _Recipe(RECIPES_DIR.joinpath(file_name), f"strop/recipes/{file_name}", builtin=True)
    return None


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (plain YAML keeps
    the last value silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None,
                    f"key {key!r} appears twice (first on line {seen[key] + 1}); keep one",
                    key_node.start_mark,
                )  # fmt: skip
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _read(recipe: _Recipe) -> dict[str, Any]:
    """The top-level mapping of a recipe file."""
    try:
        text = recipe.file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read recipe {recipe.label}: {e}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).replace("\n", " ")
        raise ConfigError(f"invalid YAML in {recipe.label}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"recipe {recipe.label} must be a mapping of keys to values at the top level, "
            f"not a {type(data).__name__}"
        )
    return data


def recipe_layers(recipe: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """The recipe and its ``base:`` chain as ``(label, values)`` pairs, most basic first.

    A run directory is its ``config.yaml`` with ``run_dir`` the directory itself (as named
    now: the run continues there, wherever it was when it started), so ``strop ppo runs/x``
    continues the run ``strop export runs/x`` exports.
    """
    if (Path(recipe) / RUN_CONFIG_FILE).is_file():
        return [
            *recipe_layers(Path(recipe) / RUN_CONFIG_FILE),
            (f"run directory {recipe}", {"run_dir": str(recipe)}),
        ]
    found = _find(str(recipe), None)
    if found is None and Path(recipe).is_dir():
        raise ConfigError(
            f"recipe {str(recipe)!r} is a directory without {RUN_CONFIG_FILE} (a run "
            "directory holds one once its first run started): name a recipe file, a built-in "
            "recipe or a run directory"
        )
    if found is None:
        close = difflib.get_close_matches(
            Path(str(recipe)).name.removesuffix(".yaml"), builtin_recipes(), n=1
        )
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"recipe {str(recipe)!r} not found{hint}: no such file and no built-in recipe of "
            f"that name (built-in recipes: {', '.join(builtin_recipes())}; `strop recipes` "
            "describes them)"
        )
    layers: list[tuple[str, dict[str, Any]]] = []
    chain: list[_Recipe] = []
    current: _Recipe | None = found
    while current is not None:
        if current.identity() in [r.identity() for r in chain]:
            cycle = " -> ".join(r.label for r in [*chain, current])
            raise ConfigError(f"recipe bases form a cycle: {cycle}")
        chain.append(current)
        data = _read(current)
        base = data.pop("base", None)
        layers.append((current.label, data))
        if base is None:
            break
        if not isinstance(base, str) or not base:
            raise ConfigError(
                f"'base' in {current.label} must be a recipe path or name, got {base!r}"
            )
        current = _find(base, current)
        if current is None:
            raise ConfigError(
                f"base recipe {base!r} named in {chain[-1].label} not found (paths are relative "
                f"to that file; built-in recipes: {', '.join(builtin_recipes())})"
            )
    return layers[::-1]


def merge_layer(
    values: dict[str, Any],
    provenance: Provenance,
    layer: dict[str, Any],
    source: str,
    prefix: str = "",
) -> None:
    """Deep-merge ``layer`` into ``values`` in place and record ``source`` for each key it sets.

    Mappings merge key by key; anything else (lists included) replaces what was there.
    """
    for key, value in layer.items():
        dotted = f"{prefix}{key}"
        provenance[dotted] = source
        if not (isinstance(value, dict) and isinstance(values.get(key), dict)):
            for stale in [k for k in provenance if k.startswith(f"{dotted}.")]:
                del provenance[stale]
            values[key] = {} if isinstance(value, dict) else value
        if isinstance(value, dict):
            merge_layer(values[key], provenance, value, source, f"{dotted}.")


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b=value`` into its key parts and its YAML-parsed value (empty = None)."""
    key, eq, raw = text.partition("=")
    parts = [p.strip() for p in key.split(".")]
    if not eq or not all(parts):
        raise ConfigError(
            f"bad override {text!r}: expected KEY=VALUE with a dotted key, e.g. optim.lr=1e-5"
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or "cannot parse"
        raise ConfigError(
            f"bad override {text!r}: the value is not valid YAML ({problem})"
        ) from None
    return parts, value


def overrides_set(overrides: Sequence[str], key: str) -> bool:
    """Whether one of ``overrides`` sets the dotted ``key``: by name (``ppo.old_logprobs=x``)
    or inside a mapping given for a section above it (``ppo={old_logprobs: x}``)."""
    wanted = key.split(".")
    for text in overrides:
        parts, value = parse_override(text)
        if parts == wanted[: len(parts)]:
            for part in wanted[len(parts) :]:
                if not isinstance(value, dict) or part not in value:
                    break
                value = value[part]
            else:
                return True
    return False


def _section(model: type[BaseModel] | None, key: str) -> type[BaseModel] | None:
    """The sub-model that field ``key`` of ``model`` holds, if it holds one."""
    field = model.model_fields.get(key) if model is not None else None
    annotation = field.annotation if field is not None else None
    return (
        annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    )


def apply_override(
    values: dict[str, Any], provenance: Provenance, text: str, schema: type[BaseModel]
) -> None:
    """Set one ``key=value`` override into ``values``; refuses to set keys inside a plain value."""
    parts, value = parse_override(text)
    node: Any = values
    model: type[BaseModel] | None = schema
    for depth, part in enumerate(parts[:-1]):
        if isinstance(node, dict) and part in node:
            node = node[part]
            is_value = not isinstance(node, dict)
        else:
            node = None
            is_value = (
                model is not None and part in model.model_fields and _section(model, part) is None
            )
        if is_value:
            where = ".".join(parts[: depth + 1])
            raise ConfigError(
                f"bad override {text!r}: {where!r} is a single value, not a section with keys"
            )
        model = _section(model, part)
    layer: Any = value
    for part in reversed(parts):
        layer = {part: layer}
    merge_layer(values, provenance, layer, f"override {text!r}")


def _source(provenance: Provenance, parts: list[str]) -> str:
    """Label of what set the key ``parts``, or the enclosing value it is part of (a list)."""
    key = ".".join(parts)
    if key in provenance:
        return provenance[key]
    for n in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:n])
        # A section (a mapping merged key by key) does not vouch for keys it did not set.
        if prefix in provenance and not any(k.startswith(f"{prefix}.") for k in provenance):
            return provenance[prefix]
    return "default"


def _model_at(schema: type[BaseModel], parts: list[str]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = schema
    for part in parts:
        model = _section(model, part)
    return model


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


# Keys an earlier strop had and read nothing from, and what to use instead.
REMOVED_KEYS = {
    "sft.log_every": "removed (it was never read); metrics are written every "
    "logging.every_steps steps",
}


def _describe(error: Any, provenance: Provenance, schema: type[BaseModel]) -> str:
    """One pydantic error as one line: key, reason, value and where the value came from."""
    parts = [str(p) for p in error["loc"]]
    key = ".".join(parts)
    if error["type"] == "extra_forbidden":
        message = f"unknown key {key!r} (in {_source(provenance, parts)})"
        if key in REMOVED_KEYS:
            return f"{message}: {REMOVED_KEYS[key]}"
        parent = _model_at(schema, parts[:-1])
        close = difflib.get_close_matches(
            parts[-1], list(parent.model_fields) if parent else [], n=1
        )
        return (
            f"{message}, did you mean {'.'.join([*parts[:-1], close[0]])!r}?" if close else message
        )
    reason = error["msg"].removeprefix("Value error, ")
    if error["type"] == "value_error" and isinstance(error["input"], dict):
        # A check across several keys: say where each key it names came from.
        named = dict.fromkeys(re.findall(r"\b[a-z_]+(?:\.[a-z_]+)+\b", reason))
        origins = [
            f"{k} from {_source(provenance, k.split('.'))}"
            for k in named
            if (m := _model_at(schema, k.split(".")[:-1])) and k.split(".")[-1] in m.model_fields
        ]
        return f"{reason} ({', '.join(origins)})" if origins else reason
    return f"{key}: {reason} (got {_short(error['input'])} from {_source(provenance, parts)})"


def describe_validation_error(
    err: ValidationError, provenance: Provenance, schema: type[BaseModel]
) -> str:
    """A one-line message for a failed validation of ``schema``: up to three problems."""
    errors = err.errors(include_url=False)
    lines = [_describe(e, provenance, schema) for e in errors[:_MAX_ERRORS]]
    more = f"; and {len(errors) - _MAX_ERRORS} more" if len(errors) > _MAX_ERRORS else ""
    return ("; ".join(lines) + more).replace("\n", " ")

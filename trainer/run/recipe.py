"""Recipe loading: YAML recipe + dotted overrides -> a checked `SluiceConfig`.

OmegaConf does the merge (and `${...}` interpolation); the typed build here rejects
unknown keys with the closest valid key, names the key and expected type on a type
error, and leaves cross-field checks to `trainer.run.config.check_config`.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from trainer.run.config import SluiceConfig, iter_fields

T = TypeVar("T")
RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


class ConfigError(ValueError):
    """A recipe or override the schema rejects; the message says what to change."""


def resolve_recipe_path(recipe: str) -> Path:
    """`recipe=` accepts a path, or a file name inside the project's recipes/ folder."""
    given = Path(recipe).expanduser()
    for candidate in (given, RECIPES_DIR / recipe):
        if candidate.is_file():
            return candidate
    known = sorted(p.name for p in RECIPES_DIR.glob("*.yaml"))
    raise ConfigError(f"recipe {recipe!r} not found as a path or in {RECIPES_DIR}; "
                      f"known recipes: {', '.join(known) or 'none'}")


def load_config(recipe: str | None, overrides: list[str] | tuple[str, ...] = ()) -> SluiceConfig:
    """Merge a recipe file (or the schema defaults when None) with `a.b=c` overrides."""
    return build_config(read_layers(resolve_recipe_path(recipe) if recipe else None, overrides))


def read_layers(path: Path | None, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """A YAML file (None: nothing) merged with `a.b=c` overrides, as plain data."""
    from omegaconf import OmegaConf  # deferred: only config loading needs it
    from omegaconf.errors import OmegaConfBaseException

    try:
        layers = [_load_yaml(path)] if path is not None else []
        for item in overrides:
            if "=" not in item or item.startswith("="):
                raise ConfigError(f"override {item!r} is not of the form key.path=value")
            layers.append(_load_override(item))
        merged = OmegaConf.to_container(OmegaConf.merge(*layers), resolve=True) if layers else {}
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot read the recipe: {exc}") from exc
    if merged is None:
        merged = {}
    if not isinstance(merged, dict):
        raise ConfigError(f"a recipe must be a mapping of sections, got {type(merged).__name__}")
    return {str(key): value for key, value in merged.items()}


def _load_yaml(path: Path) -> Any:
    """The recipe file as OmegaConf; a YAML syntax error becomes one line
    `file:line:column: problem`, the place to fix (no traceback)."""
    import yaml
    from omegaconf import OmegaConf

    try:
        return OmegaConf.load(path)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{_yaml_error(exc, str(path))} (the recipe is not valid YAML)") from None


def _load_override(item: str) -> Any:
    import yaml
    from omegaconf import OmegaConf

    try:
        return OmegaConf.from_dotlist([item])
    except yaml.YAMLError as exc:  # the value is parsed as YAML: `a=[1,` fails here
        raise ConfigError(f"override {item!r}: its value is not valid YAML "
                          f"({_yaml_error(exc, None)}); quote it or fix the brackets") from None


def _yaml_error(exc: Exception, path: str | None) -> str:
    """`path:line:column: problem (context at line L)` from a PyYAML error."""
    import yaml

    marked = exc if isinstance(exc, yaml.MarkedYAMLError) else None
    mark = marked.problem_mark if marked else None
    problem = (marked.problem if marked else None) or str(exc).splitlines()[0]
    where = ""
    if mark is not None:
        where = f"{path}:{mark.line + 1}:{mark.column + 1}: " if path else \
            f"column {mark.column + 1}: "
    elif path:
        where = f"{path}: "
    context, context_mark = (marked.context, marked.context_mark) if marked else (None, None)
    extra = ""
    if context and context_mark is not None and (mark is None or context_mark.line != mark.line):
        extra = f" ({context} at line {context_mark.line + 1})"
    elif context:
        extra = f" ({context})"
    return f"{where}{problem}{extra}"


def build_config(data: dict[str, Any]) -> SluiceConfig:
    """Typed build of the whole schema from plain data; raises ConfigError/ValueError."""
    return build_section(SluiceConfig, data)


def build_section(cls: type[T], data: dict[str, Any],
                  lists_keys: str = "python -m trainer.main --help") -> T:
    """Typed build of any knob schema (the run's, or a tool's own such as the planner's
    profile) from plain data; unknown keys name the closest one and `lists_keys`."""
    all_keys = [key for key, _ in iter_fields(cls)]
    return _build(cls, data, "", (all_keys, lists_keys))


def _build(cls: type, data: Any, prefix: str, known_keys: tuple[list[str], str]) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'recipe'}: expected a mapping of keys, "
                          f"got {type(data).__name__} {data!r}")
    known = {f.name: f for f in fields(cls)}
    for name in data:
        if name not in known:
            raise ConfigError(_unknown_key_message(prefix, name, list(known), *known_keys))
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for name, value in data.items():
        key, hint = f"{prefix}{name}", hints[name]
        if is_dataclass(hint):
            values[name] = _build(hint, value, key + ".", known_keys)
        else:
            values[name] = _coerce(key, hint, value)
    return cls(**values)


def _unknown_key_message(prefix: str, name: str, siblings: list[str], all_keys: list[str],
                         lists_keys: str) -> str:
    """Suggest, in order: a near sibling, the same leaf in another section, any near key."""
    key = prefix + name
    near = difflib.get_close_matches(name, siblings, n=1, cutoff=0.6)
    elsewhere = [k for k in all_keys if k.rsplit(".", 1)[-1] == name]
    if near:
        suggestion = prefix + near[0]
    elif elsewhere:
        suggestion = elsewhere[0]
    else:
        anywhere = difflib.get_close_matches(key, all_keys, n=1, cutoff=0.6)
        suggestion = anywhere[0] if anywhere else ""
    hint = f"; did you mean {suggestion!r}?" if suggestion else ""
    return f"unknown config key {key!r}{hint} ({lists_keys} lists every key)"


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    return hint.__name__ if isinstance(hint, type) else str(hint)


def _coerce(key: str, hint: Any, value: Any) -> Any:
    """Check `value` against `hint`; ints are accepted where floats are expected."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(hint):
            try:
                return _coerce(key, arm, value)
            except ConfigError:
                continue
    elif origin is Literal:
        if value in typing.get_args(hint) and type(value) is type(typing.get_args(hint)[0]):
            return value
    elif hint is type(None):
        if value is None:
            return None
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin is dict and typing.get_args(hint)[0] is str:
        # Mapping knobs: names to values of one schema type, each checked under its own
        # dotted key (envs.tools.NAME, model.rope_scaling.factor).
        value_hint = typing.get_args(hint)[1]
        if value is None:  # OmegaConf merges mappings key by key: null is how one is emptied
            return {}
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {k: _coerce(f"{key}.{k}", value_hint, v) for k, v in value.items()}
        if isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping with string keys, got {value!r}")
    else:
        raise TypeError(f"schema type {hint!r} of {key} is not supported by the recipe loader")
    raise ConfigError(f"{key}: expected {_type_name(hint)}, got {type(value).__name__} {value!r}")

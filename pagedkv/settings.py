"""Configuration loading shared by both services: defaults < YAML file < environment < overrides.

Environment beats the file so a container can override one knob without a new file; the
explicit overrides (command-line flags) beat both. Validation problems surface as one
`ConfigError` listing every problem, which the CLIs print as a one-line error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml  # type: ignore[import-untyped]  # PyYAML ships no types and types-PyYAML is not a dependency
from pydantic import ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, YamlConfigSettingsSource

from pagedkv.logging import LEVELS, level_number


class ConfigError(ValueError):
    """The configuration file or environment is invalid."""


class YamlEnvSettings(BaseSettings):
    """Settings read from init kwargs, then the environment, then an optional YAML file."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        yaml_file = init_settings.init_kwargs.pop("_yaml_file", None)  # type: ignore[attr-defined]  # it is an InitSettingsSource
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if yaml_file is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=yaml_file))
        return tuple(sources)


S = TypeVar("S", bound=YamlEnvSettings)


def checked_log_level(name: str) -> str:
    """The canonical name of a log level ("debug" -> "DEBUG"); `ValueError` (a config problem)
    for anything else, so a typo is reported instead of silently logging at INFO."""
    level_number(name)
    upper = name.strip().upper()
    return "WARNING" if upper == "WARN" else upper


def _yaml_problem(path: Path, exc: yaml.YAMLError) -> str:
    """One line for a YAML syntax error: what and where (PyYAML's text spans several lines)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"config file {path} is not valid YAML: {problem}{where}"


def _check_yaml_mapping(path: Path) -> None:
    """`ConfigError` unless `path` holds a YAML mapping (or nothing)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_problem(path, exc)) from None
    if doc is not None and not isinstance(doc, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings, not a {type(doc).__name__}")


def load_settings(cls: type[S], path: str | Path | None, overrides: dict[str, Any]) -> S:
    """Build `cls` from defaults < YAML `path` < environment < `overrides`."""
    kwargs: dict[str, Any] = dict(overrides)
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        _check_yaml_mapping(p)
        kwargs["_yaml_file"] = p
    try:
        return cls(**kwargs)
    except ValidationError as exc:
        problems = "; ".join(_problem(e) for e in exc.errors())
        raise ConfigError(f"invalid configuration: {problems}") from None
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read configuration: {exc}") from None


def _problem(error: Any) -> str:
    """`field: message` for one of pydantic's errors, without the "Value error, " it puts in
    front of our validators' own messages (a model-wide check has no field)."""
    message = str(error["msg"]).removeprefix("Value error, ")
    loc = ".".join(map(str, error["loc"]))
    return f"{loc}: {message}" if loc else message


__all__ = ["LEVELS", "ConfigError", "YamlEnvSettings", "checked_log_level", "load_settings"]

"""Configuration loading shared by both services: defaults < YAML file < environment < overrides.

Environment beats the file so a container can override one knob without a new file; the
explicit overrides (command-line flags) beat both. Validation problems surface as one
`ConfigError` listing every problem, which the CLIs print as a one-line error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, YamlConfigSettingsSource


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
        yaml_file = init_settings.init_kwargs.pop("_yaml_file", None)  # type: ignore[attr-defined]
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if yaml_file is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=yaml_file))
        return tuple(sources)


S = TypeVar("S", bound=YamlEnvSettings)


def load_settings(cls: type[S], path: str | Path | None, overrides: dict[str, Any]) -> S:
    """Build `cls` from defaults < YAML `path` < environment < `overrides`."""
    kwargs: dict[str, Any] = dict(overrides)
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        kwargs["_yaml_file"] = p
    try:
        return cls(**kwargs)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"invalid configuration: {problems}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read configuration: {exc}") from None

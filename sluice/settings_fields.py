"""Settings whose default lives on a config dataclass: declared once, copied by name.

`from_config(EngineConfig, "kv_cache_mb", gt=0, description=...)` is a pydantic field
whose default is the dataclass field's, so each default is written in one place (the
dataclass, which its own users and tests read too); `config_kwargs(settings,
EngineConfig)` gathers the values of every setting declared so, under the dataclass's
field names, to build one. A setting keeps its `SLUICE_*` name where that differs from
the field it fills (`SLUICE_ENGINE_GROUP_ID` fills `EngineWorkerConfig.group_id`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "SLUICE_"
# the key in a field's json_schema_extra naming the dataclass field it fills
_TARGET = "config_field"
# a field's json_schema_extra for a credential: `sluice config` shows whether it is set,
# never its value
SECRET: dict[str, Any] = {"secret": True}


class SettingsBase(BaseSettings):
    """Every settings class: `SLUICE_*` variables, unknown ones ignored, frozen once built."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)


def config_default(cls: type, name: str) -> Any:
    """The default of dataclass `cls`'s field `name` (its factory's value, if it has one)."""
    for f in dataclasses.fields(cls):
        if f.name != name:
            continue
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        raise TypeError(f"{cls.__name__}.{name} has no default")
    raise TypeError(f"{cls.__name__} has no field {name!r}")


def from_config(cls: type, name: str, **field: Any) -> Any:
    """A pydantic field that defaults to `cls.name`'s default and fills that field in
    `config_kwargs(settings, cls)`; `field`: the rest of `pydantic.Field`'s arguments."""
    target = f"{cls.__qualname__}.{name}"
    return Field(default=config_default(cls, name), json_schema_extra={_TARGET: target}, **field)


def config_target(settings_cls: type[BaseModel], setting: str) -> str | None:
    """`'EngineConfig.kv_cache_mb'` for a setting declared with `from_config`, else None."""
    extra = settings_cls.model_fields[setting].json_schema_extra
    target = extra.get(_TARGET) if isinstance(extra, dict) else None
    return target if isinstance(target, str) else None


def is_secret(settings_cls: type[BaseModel], setting: str) -> bool:
    """Whether the setting holds a credential (declared with `json_schema_extra=SECRET`)."""
    extra = settings_cls.model_fields[setting].json_schema_extra
    return isinstance(extra, dict) and extra.get("secret") is True


def config_kwargs(settings: BaseModel, cls: type) -> dict[str, Any]:
    """The values of `settings`' fields declared with `from_config(cls, ...)`, keyed by
    the names of the fields of `cls` they fill."""
    prefix = f"{cls.__qualname__}."
    kwargs = {}
    for setting in type(settings).model_fields:
        target = config_target(type(settings), setting)
        if target is not None and target.startswith(prefix):
            kwargs[target.removeprefix(prefix)] = getattr(settings, setting)
    return kwargs


def comma_list(value: Any) -> Any:
    """A list setting given as one string: its comma-separated items, stripped, empty ones
    dropped; anything else as it is (pydantic checks it)."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value

"""What the gateway serves: models with their tokenizers, injected by the composition root.

The gateway tokenizes and renders chat templates itself (docs/architecture.md §4: prompt
token ids travel on the bus), through the `Tokenizer` protocol; `engine.tokenizer.Tokenizer` is
the real one, passed in from `sluice/` because `api` never imports `engine`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sluice.api.errors import InvalidRequest, ModelNotFound
from sluice.bus.messages import AdapterRef
from sluice.bus.topics import pool_id
from sluice.storage.adapters import AdapterInfo
from sluice.storage.keys import Principal

logger = logging.getLogger(__name__)


class Tokenizer(Protocol):
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_token_chars(self) -> int:
        """The most characters of text one token can cover (bounds a prompt's chars)."""
        ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """May run on a worker thread: long texts must not hold the GIL throughout."""
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """`kwargs` reach the template as variables (`tools`, as transformers passes them)."""
        ...


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One entry of `GET /v1/models`, and what validation needs to know about it."""

    name: str
    max_model_len: int
    tokenizer: Tokenizer
    # how the model writes tool calls and reasoning (SLUICE_TOOL_PARSER, SLUICE_REASONING_PARSER)
    tool_parser: str = "hermes"
    reasoning_parser: str = "none"
    # (kind, value) of a StructuredSpec → raises ValueError when it cannot compile for this
    # model's vocabulary (`engine.structured.GrammarCompiler.check`); None: not checked
    check_constraint: Callable[[str, str], None] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    owned_by: str = "sluice"
    # an adapter's view of its base model: `name` is the adapter's, `parent` the base's
    parent: str | None = None
    adapter: AdapterRef | None = None

    @property
    def base_name(self) -> str:
        """The base model the pool serves: what a GenerateRequest's `model` names."""
        return self.parent or self.name

    @property
    def pool(self) -> str:
        """The pool whose request topics carry this model's requests."""
        return pool_id(self.base_name)


@dataclass(frozen=True, slots=True)
class LoraModule:
    """A LoRA adapter served from start (`--lora NAME=PATH[@BASE]`, SLUICE_LORA_MODULES):
    public, on the pool of `base` (None: the deployment's first model)."""

    name: str
    path: str
    base: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoraModule:
        """`NAME=PATH` or `NAME=PATH@BASE` (a path holding '@' needs its `@BASE`)."""
        name, sep, rest = (p.strip() for p in text.partition("="))
        path, at, base = (
            (p.strip() for p in rest.rpartition("@")) if "@" in rest else (rest, "", "")
        )
        if not (sep and name and path) or (at and not base):
            raise ValueError(f"{text!r}: write NAME=PATH or NAME=PATH@BASE")
        return cls(name, path, base or None)


@dataclass(frozen=True, slots=True)
class Listed:
    """One entry of `GET /v1/models`: what the name answers as, and vLLM's `root` (an
    alias's target, an adapter's path, a model's own name) and `parent` (an adapter's base)."""

    id: str
    model: ServedModel
    root: str
    parent: str | None = None


class AdapterRegistry(Protocol):
    """The adapters loaded at run time (`storage.adapters.AdapterStore`)."""

    def list(self, tenant_id: str | None = None) -> list[AdapterInfo]: ...


class ModelCatalog:
    """Served models by name, aliases (`gpt-4o-mini` → a served model: an alias answers as
    its target, the way OpenAI's aliases answer with the snapshot's name) and LoRA adapters
    (each a view of its base model, `ServedModel.adapter` set), and who may use which.

    Adapters come from start (`adapters`, public) and from the registry shared by every
    gateway on the database. Asking the registry per request would put a query on every
    request, so the catalog keeps a snapshot, refreshed every `refresh_s` by
    `refresh_forever` (the gateway's lifespan) or `refresh()` (the batch runner): an
    adapter loaded through another gateway is served here within `refresh_s`; the gateway
    that loads one refreshes at once. While the database is down the last snapshot serves.

    `get(name, principal)` answers a name the principal may not use exactly as a name that
    does not exist (404 `model_not_found`), so nothing tells a tenant what others have.
    """

    def __init__(
        self,
        models: Sequence[ServedModel],
        aliases: Mapping[str, str] | None = None,
        adapters: Sequence[LoraModule] = (),
        registry: AdapterRegistry | None = None,
        refresh_s: float = 2.0,
    ) -> None:
        self._models = {m.name: m for m in models}
        pools: dict[str, str] = {}
        for m in models:
            other = pools.setdefault(m.pool, m.name)
            if other != m.name:
                raise InvalidRequest(f"models {other!r} and {m.name!r} share pool {m.pool!r}")
        self._default_base = models[0].name if models else None
        started = dt.datetime.now(dt.UTC)
        self._static: dict[str, tuple[AdapterInfo, ServedModel]] = {}
        for module in adapters:
            base = module.base or self._default_base or ""
            info = AdapterInfo(module.name, base, module.path, None, started)
            self._check_static(module.name, base)
            self._static[module.name] = (info, self._view(info))
        self.aliases = dict(aliases or {})
        for alias, target in self.aliases.items():
            if target not in self._models and target not in self._static:
                raise InvalidRequest(f"alias {alias!r} names {target!r}, which is not served")
            if alias in self._models or alias in self._static:
                raise InvalidRequest(f"alias {alias!r} is already a served model's name")
        self._registry = registry
        self.refresh_s = refresh_s
        # the registry's adapters served here, as of the last refresh: replaced whole, so
        # a request on the loop never sees one half-built on the refresh's thread
        self._loaded: dict[str, tuple[AdapterInfo, ServedModel]] = {}

    def __iter__(self) -> Any:
        """The base models (one pool each)."""
        return iter(self._models.values())

    @property
    def pools(self) -> tuple[str, ...]:
        return tuple(m.pool for m in self._models.values())

    @property
    def default_base(self) -> str | None:
        """The deployment's first model: an adapter's base when none is named."""
        return self._default_base

    def get(self, name: str, principal: Principal | None = None) -> ServedModel:
        """What `name` answers as (a model, an alias's target, an adapter's view); with a
        `principal`, only what it may use. None: no access check (in-process callers)."""
        model = self._lookup(name)
        if model is None or (principal is not None and not self._allowed(name, principal)):
            raise _not_found(name)
        return model

    def listed(self, principal: Principal | None = None) -> list[Listed]:
        """`GET /v1/models`: the models, aliases and adapters `principal` may use."""
        entries = [Listed(m.name, m, m.name) for m in self._models.values()]
        for alias, target in self.aliases.items():
            entries.append(
                Listed(alias, self._models.get(target) or self._static[target][1], target)
            )
        adapters = {**self._loaded, **self._static}
        entries += [Listed(n, v, i.path, i.base_model) for n, (i, v) in adapters.items()]
        return [e for e in entries if principal is None or self._allowed(e.id, principal)]

    def entry(self, name: str, principal: Principal | None = None) -> Listed:
        """`GET /v1/models/{name}`: its entry, or 404 as `get` answers."""
        for entry in self.listed(principal):
            if entry.id == name:
                return entry
        raise _not_found(name)

    def taken(self, name: str) -> bool:
        """Whether `name` is served already: a model, an alias or an adapter (any tenant's)."""
        return self._lookup(name) is not None

    def started_with(self, name: str) -> bool:
        """Whether `name` is an alias or adapter of the settings (not the registry's)."""
        return name in self.aliases or name in self._static

    def has_base(self, name: str) -> bool:
        return name in self._models

    # -- the registry's snapshot ---------------------------------------------------------
    def refresh(self) -> None:
        """Read the registry again (blocking: one query); its errors reach the caller."""
        if self._registry is None:
            return
        adapters: dict[str, tuple[AdapterInfo, ServedModel]] = {}
        for info in self._registry.list():
            # one whose base this deployment does not serve, or whose name a model of the
            # settings took since it was loaded, is not served here
            if info.base_model in self._models and self._lookup_static(info.name) is None:
                known = self._loaded.get(info.name)  # unchanged: its view is reused
                adapters[info.name] = (
                    known if known and known[0] == info else (info, self._view(info))
                )
        self._loaded = adapters

    async def refresh_forever(self) -> None:
        """Refresh every `refresh_s` until cancelled; a failed refresh keeps the snapshot."""
        while self._registry is not None:
            try:
                await asyncio.to_thread(self.refresh)
            except Exception as exc:  # the store's outage must not stop serving the rest
                logger.warning("LoRA adapter registry not refreshed: %s", exc)
            await asyncio.sleep(self.refresh_s)

    # -- internals -----------------------------------------------------------------------
    def _lookup_static(self, name: str) -> ServedModel | None:
        target = self.aliases.get(name, name)
        model = self._models.get(target)
        if model is None and target in self._static:
            model = self._static[target][1]
        return model

    def _lookup(self, name: str) -> ServedModel | None:
        model = self._lookup_static(name)
        if model is None and name in self._loaded:
            model = self._loaded[name][1]
        return model

    def _adapter(self, name: str) -> AdapterInfo | None:
        found = self._static.get(name) or self._loaded.get(name)
        return found[0] if found is not None else None

    def _allowed(self, name: str, principal: Principal) -> bool:
        """A name in the tenant's allowed models; an alias of an allowed name; a public
        adapter of an allowed base; a private adapter to its own tenant alone."""
        allowed = principal.allowed_models
        adapter = self._adapter(name)
        if adapter is not None and adapter.owner_tenant_id is not None:
            return adapter.owner_tenant_id == principal.tenant_id
        if allowed is None or name in allowed:
            return True
        if adapter is not None:
            return self._allowed(adapter.base_model, principal)
        target = self.aliases.get(name)
        return target is not None and self._allowed(target, principal)

    def _check_static(self, name: str, base: str) -> None:
        if base not in self._models:
            raise InvalidRequest(f"LoRA adapter {name!r}: its base {base!r} is not served")
        if name in self._models or name in self._static:
            raise InvalidRequest(f"LoRA adapter {name!r}: the name is already served")

    def _view(self, info: AdapterInfo) -> ServedModel:
        base = self._models[info.base_model]
        return dataclasses.replace(
            base,
            name=info.name,
            parent=base.name,
            adapter=AdapterRef(name=info.name, path=info.path),
            created=int(info.created_at.timestamp()),
            owned_by=info.owner_tenant_id or base.owned_by,
        )


def _not_found(name: str) -> ModelNotFound:
    return ModelNotFound(
        f"the model '{name}' does not exist; GET /v1/models lists the served ones",
        param="model",
    )

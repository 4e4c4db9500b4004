"""The model catalog: models, aliases and LoRA adapters, and who may use which."""

from __future__ import annotations

import datetime as dt

import pytest

from sluice.api.errors import InvalidRequest, ModelNotFound
from sluice.api.served import LoraModule, ModelCatalog
from sluice.storage.adapters import AdapterInfo
from sluice.storage.keys import Principal
from tests.unit.api.fakes import served_model

NOW = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)


class Registry:
    """The adapters loaded at run time, as `storage.adapters.AdapterStore.list` reads them."""

    def __init__(self, *adapters: AdapterInfo) -> None:
        self.adapters = list(adapters)

    def list(self, tenant_id: str | None = None) -> list[AdapterInfo]:
        return [a for a in self.adapters if tenant_id is None or a.visible_to(tenant_id)]


def catalog(registry: Registry | None = None) -> ModelCatalog:
    c = ModelCatalog(
        [served_model("base"), served_model("other")],
        {"alias": "base", "sql-alias": "sql"},
        [LoraModule("sql", "/adapters/sql"), LoraModule("poem", "/adapters/poem", "other")],
        registry,
    )
    c.refresh()
    return c


def names(c: ModelCatalog, principal: Principal | None) -> set[str]:
    return {e.id for e in c.listed(principal)}


def test_lora_module_syntax() -> None:
    assert LoraModule.parse("a=/x") == LoraModule("a", "/x")
    assert LoraModule.parse(" a = /x@b ") == LoraModule("a", "/x", "b")
    assert LoraModule.parse("a=/p@th@b") == LoraModule("a", "/p@th", "b")
    for bad in ("a", "=/x", "a=", "a=/x@"):
        with pytest.raises(ValueError, match="NAME=PATH"):
            LoraModule.parse(bad)


def test_an_adapter_is_a_view_of_its_base() -> None:
    c = catalog()
    sql = c.get("sql")
    assert (sql.name, sql.parent, sql.base_name, sql.pool) == ("sql", "base", "base", "base")
    assert sql.adapter is not None and sql.adapter.path == "/adapters/sql"
    assert c.get("poem").base_name == "other"
    assert c.get("alias").name == "base" and c.get("alias").adapter is None
    assert c.get("sql-alias").adapter == sql.adapter
    entries = {e.id: e for e in c.listed()}
    assert (entries["sql"].root, entries["sql"].parent) == ("/adapters/sql", "base")
    assert (entries["alias"].root, entries["alias"].parent) == ("base", None)
    assert [m.name for m in c] == ["base", "other"]  # the pools: bases alone


def test_settings_that_do_not_add_up_are_refused_at_start() -> None:
    models = [served_model("base")]
    with pytest.raises(InvalidRequest, match="not served"):
        ModelCatalog(models, adapters=[LoraModule("x", "/x", "nope")])
    with pytest.raises(InvalidRequest, match="already served"):
        ModelCatalog(models, adapters=[LoraModule("base", "/x")])
    with pytest.raises(InvalidRequest, match="already a served model"):
        ModelCatalog(models, {"x": "base"}, [LoraModule("x", "/x")])


def test_private_adapters_are_their_tenants_alone() -> None:
    c = catalog(Registry(AdapterInfo("mine", "base", "/a/mine", "ten_a", NOW)))
    a, b = Principal("ten_a"), Principal("ten_b")
    assert c.get("mine", a).owned_by == "ten_a"
    with pytest.raises(ModelNotFound) as hidden:
        c.get("mine", b)
    with pytest.raises(ModelNotFound) as unknown:
        c.get("nothing", b)
    # the same answer as a name that does not exist, but for the name
    h, u = hidden.value.body()["error"], unknown.value.body()["error"]
    assert (h["type"], h["code"], h["param"]) == (u["type"], u["code"], u["param"])
    assert h["code"] == "model_not_found" and hidden.value.status_code == 404
    assert h["message"] == u["message"].replace("nothing", "mine")
    assert "mine" in names(c, a) and "mine" not in names(c, b)
    # even a tenant restricted to other models keeps its own adapter
    assert c.get("mine", Principal("ten_a", allowed_models=frozenset({"other"}))).parent == "base"


def test_allowed_models_name_models_aliases_and_adapters() -> None:
    c = catalog(Registry(AdapterInfo("pub", "base", "/a/pub", None, NOW)))
    only_alias = Principal("t", allowed_models=frozenset({"alias"}))
    assert names(c, only_alias) == {"alias"}
    with pytest.raises(ModelNotFound):
        c.get("base", only_alias)
    # a base allows its aliases and public adapters
    assert names(c, Principal("t", allowed_models=frozenset({"base"}))) == {
        "base", "alias", "sql", "sql-alias", "pub"
    }  # fmt: skip
    # an adapter alone, without its base
    only_sql = Principal("t", allowed_models=frozenset({"sql"}))
    assert names(c, only_sql) == {"sql", "sql-alias"}
    assert c.get("sql", only_sql).adapter is not None
    assert names(c, Principal("t", allowed_models=frozenset())) == set()
    assert names(c, Principal("t")) == names(c, None)


def test_the_registry_is_read_on_refresh_and_kept_through_an_outage() -> None:
    registry = Registry()
    c = catalog(registry)
    registry.adapters.append(AdapterInfo("late", "other", "/a/late", None, NOW))
    # elsewhere served models win over a registry entry of the same name; an adapter
    # of a base this deployment does not serve is not served here
    registry.adapters.append(AdapterInfo("alias", "base", "/a/x", None, NOW))
    registry.adapters.append(AdapterInfo("far", "elsewhere", "/a/far", None, NOW))
    with pytest.raises(ModelNotFound):
        c.get("late")
    c.refresh()
    assert c.get("late").base_name == "other"
    assert c.get("alias").adapter is None
    assert c.taken("late") and c.taken("alias") and not c.taken("far")

    def down(tenant_id: str | None = None) -> list[AdapterInfo]:
        raise ConnectionError("database down")

    registry.list = down  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        c.refresh()
    assert c.get("late").base_name == "other"

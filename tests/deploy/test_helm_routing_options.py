"""The chart's ``router.routingOptions`` are cache_aware's settings: the schema names
exactly ``CacheAwareConfig``'s fields with their types, and what the chart renders is
what the router accepts."""

from __future__ import annotations

import dataclasses
import json
import typing

import helm_python as helm
import pytest

from unicache.router.config import build_config
from unicache.router.routing.cache_aware.policy import CacheAwareConfig
from tests.deploy.test_helm_chart import CHART, documents, render

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
TYPES = {bool: "boolean", int: "integer", float: "number"}


def test_the_schema_names_every_field_of_cache_aware_config_with_its_type():
    props = SCHEMA["properties"]["router"]["properties"]["routingOptions"]["properties"]
    hints = typing.get_type_hints(CacheAwareConfig)
    assert {name: p["type"] for name, p in props.items()} == {
        f.name: TYPES[hints[f.name]] for f in dataclasses.fields(CacheAwareConfig)}


def test_options_render_into_the_settings_the_router_reads():
    docs = documents(render({"router": {"routingOptions": {"prefill_lanes": 2, "load_weight": 0.5, "session_sticky": False}}}))
    (data,) = [d["data"] for _, d in docs if d["kind"] == "ConfigMap" and "UNICACHE_ROUTING_POLICY" in d.get("data", {})]
    cfg = build_config(env={"UNICACHE_ROUTING_OPTIONS": data["UNICACHE_ROUTING_OPTIONS"]})
    assert cfg.policy_options() == {"prefill_lanes": 2, "load_weight": 0.5, "session_sticky": False}
    plain = documents(render({}))
    assert all("UNICACHE_ROUTING_OPTIONS" not in d.get("data", {}) for _, d in plain if d["kind"] == "ConfigMap")


@pytest.mark.parametrize("bad", [{"prefil_lanes": 2}, {"prefill_lanes": "two"}, {"load_weight": -1}])
def test_the_schema_refuses_unknown_names_and_bad_types(bad):
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema({"router": {"routingOptions": bad}})

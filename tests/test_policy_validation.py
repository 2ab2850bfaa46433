"""PolicyConfig rejects every misspelt name and out-of-range number, listing what is accepted."""

import pytest

from fate_edge.errors import FateEdgeError, PolicyError
from fate_edge.runtime.policy import ALLOCATIONS, EVICTIONS, PRESETS, PolicyConfig, get_policy

BAD = [
    ("allocation", "shalow", "cost-aware"),
    ("eviction", "lur", "belady"),
    ("predictor", "cross_layer", "activation-path"),
    ("bits", 5, "16"),
    ("bits", 4.0, "16"),
    ("cold_bits", 16, "8"),
    ("lookahead", 0, ">= 1"),
    ("prefetch_width", "wide", "fate, mass"),
    ("prefetch_width", -1, ">= 0"),
    ("prefetch_mass", 0.0, "(0, 1]"),
    ("prefetch_mass", 1.5, "(0, 1]"),
    ("max_prefetch_width", 0, ">= 1"),
    ("min_prefetch_width", -1, ">= 0"),
    ("min_prefetch_width", 9, "max_prefetch_width"),  # above the default max of 8
    ("cold_tail_mass", -0.1, "[0, 1]"),
    ("t1", 2.0, "[0, 1]"),
    ("t2", -1.0, "[0, 1]"),
    ("t1", 0.95, "t2"),  # above the default t2 of 0.9
    ("full_layers", -1, ">= 0"),
    ("cache", "yes", "True or False"),
    ("prefetch_gate", 1, "True or False"),
    ("precision_on_miss", None, "True or False"),
    ("skip_past_t2", "no", "True or False"),
    ("name", "", "non-empty"),
]


@pytest.mark.parametrize("field,value,listed", BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_bad_field_is_rejected_with_the_valid_values(field, value, listed):
    with pytest.raises(PolicyError) as info:
        PolicyConfig("p", **{field: value}) if field != "name" else PolicyConfig(value)
    msg = str(info.value)
    assert field in msg and listed in msg
    assert isinstance(info.value, FateEdgeError) and isinstance(info.value, ValueError)


def test_with_validates_too():
    with pytest.raises(PolicyError, match="uniform, shallow, cost-aware, global"):
        PRESETS["fate"].with_(allocation="shalow")


def test_every_valid_value_and_every_preset_is_accepted():
    for a in ALLOCATIONS:
        assert PolicyConfig("p", allocation=a).allocation == a
    for e in EVICTIONS:
        assert PolicyConfig("p", eviction=e).eviction == e
    for w in (0, 3, "fate", "mass"):
        assert PolicyConfig("p", prefetch_width=w).prefetch_width == w
    for name, preset in PRESETS.items():
        assert PolicyConfig(**preset.__dict__) == preset, name


def test_unknown_preset_is_a_policy_error_listing_presets_and_auto():
    with pytest.raises(PolicyError, match="fate-edge.*auto"):
        get_policy("nosuch")

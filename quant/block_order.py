"""Whether int4 codes in torch's CPU layout say which block order they were packed in (64 or 32 rows, the packing
CPU's: :func:`fate_edge.quant.linear.host_int4_block_rows`). One rule for the three places that ask: the store
index's expert precisions (format.store), the resident weights a load reads (model.layer) and the store cache
deciding that a store it made is too old to read (format.store_age)."""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import Any

BLOCK_ROWS = "int4_block_rows"  # the store.json field of a cpu-int4 precision; the resident tensor's suffix


def precision_lacks_block_order(precision: Mapping[str, Any]) -> bool:
    """True for a store.json precision in the cpu-int4 layout that records no block order (written before it was)."""
    return precision.get("layout") == "cpu-int4" and precision.get(BLOCK_ROWS) is None


def resident_block_rows_name(key: str) -> str:
    """The tensor beside resident weight ``key``'s int4 codes (``<key>.int4``) holding their block order."""
    return f"{key}.{BLOCK_ROWS}"


def resident_lacks_block_order(names: Container[str], key: str) -> bool:
    """True where resident weight ``key`` is held as torch-layout int4 codes (``<key>.int4`` among ``names``)
    without its block order beside them."""
    return f"{key}.int4" in names and resident_block_rows_name(key) not in names

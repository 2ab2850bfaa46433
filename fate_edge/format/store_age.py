"""Whether a store was written by a fate-edge older than what this one needs to read it as it is: the store cache
(``converted_stores.ensure_store``) converts such a store of its own again, once, instead of failing every run.

Today's one rule: torch's CPU int4 layout depends on the packing CPU's block order, which stores now record (experts:
``int4_block_rows`` per precision in store.json; resident weights: a ``<group>.int4_block_rows`` tensor beside each
``<group>.int4``). A store from before holds neither, and the reader refuses it (format.store, model.layer): the
same rule, quant.block_order."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from fate_edge.format.store import INDEX_MAX_BYTES, STORE_FILE
from fate_edge.quant.block_order import precision_lacks_block_order, resident_lacks_block_order
from fate_edge.small_files import read_small_text

RESIDENT_FILE = "resident.safetensors"


def predates_block_order(store_dir: Path) -> bool:
    """True where ``store_dir`` holds torch-layout int4 codes (experts or resident) without their block order."""
    try:
        index = json.loads(read_small_text(store_dir / STORE_FILE, INDEX_MAX_BYTES))
    except (OSError, ValueError):
        return False  # a damaged index is the reader's to name, not a reason to overwrite
    precisions = index.get("precisions") if isinstance(index, dict) else None
    if any(isinstance(p, dict) and precision_lacks_block_order(p) for p in (precisions or {}).values()):
        return True
    resident = store_dir / RESIDENT_FILE
    if not resident.is_file():
        return False
    try:
        with safe_open(str(resident), framework="pt") as f:
            keys = set(f.keys())
    except Exception:  # a damaged file is the loader's to name
        return False
    return any(resident_lacks_block_order(keys, k.removesuffix(".int4")) for k in keys if k.endswith(".int4"))

"""Whether the scheduler computes an expert in the buffer its read landed in: kept as the cached expert's memory
(zero-copy hand-off) or lent for one use (load-on-demand), rather than copied out."""

from __future__ import annotations

from fate_edge.format.store import ExpertStore, decodes_to_views
from fate_edge.runtime.policy import PolicyConfig


def _decodes_in_buffer(policy: PolicyConfig, store: ExpertStore, device: str) -> bool:
    """Whether the policy's experts decode as views of their read buffer here: on the CPU, for a layout whose decode
    copies nothing (``store.decodes_to_views``: cpu-int4, or portable int4 on the native kernel)."""
    precision = store.precisions.get(policy.bits)
    return device == "cpu" and precision is not None and decodes_to_views(precision)


def hands_off(policy: PolicyConfig, store: ExpertStore, device: str) -> bool:
    """Whether the scheduler keeps a read buffer as the cached expert decoded in it (zero-copy hand-off): with a
    cache, where experts decode in their buffer (:func:`_decodes_in_buffer`). The cache then charges each expert a
    whole read buffer. Elsewhere experts are copied out of the buffer (on a GPU, the upload). Never for the oracle:
    the bound keeps each cached expert in its own bytes, the most experts a budget can hold (fate's resident layer is
    held so, and a bound of padded entries was beaten by it)."""
    return policy.cache and _decodes_in_buffer(policy, store, device) and policy.predictor != "oracle"


def lends(policy: PolicyConfig, store: ExpertStore, device: str) -> bool:
    """Whether an uncached expert (load-on-demand) is computed in its read buffer, which goes back to the pool once
    the layer's caller has used it, as a device computes from the memory its DMA filled. A copy out would cost this
    CPU a memcpy per read that no device pays (docs/measured-choices.md), dilated into device time under
    emulation."""
    return not policy.cache and _decodes_in_buffer(policy, store, device)

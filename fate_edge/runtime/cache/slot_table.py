"""The slot table lives with the decode step that reads it (``fate_edge.model.slot_table``); this name stays for
code written against the cache package."""

from fate_edge.model.slot_table import Key, SlotTable

__all__ = ["Key", "SlotTable"]

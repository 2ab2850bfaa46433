"""Choosing a policy: the planner, the simulator, device emulation and presets, the oracle bound."""

"""Bounds on what any policy can do on a recorded request: the oracle's best configuration in the simulator
(``oracle_bound``) and the fewest expert reads any cache could make (``read_bound``)."""

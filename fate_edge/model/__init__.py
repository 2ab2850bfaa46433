"""The model's math: architectures, the transformer and its layer, attention, routing, the decode steps."""

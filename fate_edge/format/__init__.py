"""What is on disk: checkpoints, the expert store, conversion, relayout and checksums."""

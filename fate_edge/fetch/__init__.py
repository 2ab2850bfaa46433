"""Reading expert blobs: the fetch engine, its buffer pool, host-to-device transfer, the store's expert provider."""

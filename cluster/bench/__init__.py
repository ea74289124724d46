"""`tandem bench`: each benchmark measures tandem and its baseline in the same run."""


def collect_engines() -> None:
    """Free the KV pools of engines already closed and dropped: an engine's parts refer to each
    other, so only the cycle collector frees one, and a bench making engine after engine would
    otherwise hold several pools (`kv_memory_gib` each) at once. Call before making an engine."""
    import gc

    gc.collect()

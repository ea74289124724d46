"""`tandem bench`: each benchmark measures tandem and its baseline in the same run."""


def collect_engines() -> None:
    """Free the KV pools of engines already closed and dropped, should anything still tie one into a
    reference cycle (an engine's own parts no longer do: dropping it frees its pool at once), so a
    bench making engine after engine never holds several pools (`kv_memory_gib` each) at once. Call
    before making an engine."""
    import gc

    gc.collect()

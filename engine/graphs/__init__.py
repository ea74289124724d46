"""The graph wing: steps replayed from static buffers (CUDA graphs; on CPU the same buffers, eager or
compiled), bottom to top:

    capture.py  batch-size buckets, `StaticBuffers`, `capture_graph`
    tree.py     tree verify rows (EAGLE trees) replayed from their own buffers
    runner.py   `GraphRunner`: the target's step, gated by what the KV tier is doing (`Fallback`)
    draft.py    the draft head's calls (chains and trees)
"""

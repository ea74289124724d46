"""Training for speculative decoding (docs/design.md §6): `tandem train-eagle` distils an EAGLE-3
draft head from the target's own answers (`eagle`). No torch at import: the engine's start-up asks
`default_draft_dir` whether a head is cached.

    settings.py    TrainSettings, their digest, the cache layout, default_draft_dir, ensure_head
    data.py        shipped prompts (data/*.jsonl), the target's greedy answers, its aux hidden states
    vocab.py       the reduced draft vocabulary and d2t
    unroll.py      the dense training forward: 3 draft steps unrolled as inference runs them
    trainer.py     examples, batches, the resumable optimizer loop
    evaluate.py    offline greedy chain acceptance at k = 3
    checkpoint.py  the published EAGLE-3 format, initialisation, resume state
    eagle.py       train_eagle: the pipeline, cached
    cli.py         `tandem train-eagle`
"""

from cluster.train.settings import TrainSettings, default_draft_dir, head_dir

__all__ = ["TrainSettings", "default_draft_dir", "head_dir"]

"""The speculation wing (EAGLE-3 drafting, docs/design.md §6):

    speculator.py  `EagleSpeculator` (chains and trees: draft, catch up, verify)
    factory.py     which speculator an engine runs (`NullSpeculator` when off) and its draft head, loaded and checked
    draft_tree.py  `DraftTree`: one request's tree grown level by level
    policy.py      whether drafting pays at this batch size, measured while serving
"""

"""The speculation wing (EAGLE-3 drafting, docs/design.md §6):

    speculator.py  `EagleSpeculator` (chains and trees: draft, catch up, verify) and `NullSpeculator`
    draft_tree.py  `DraftTree`: one request's tree grown level by level
    policy.py      whether drafting pays at this batch size, measured while serving
"""

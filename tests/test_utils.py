import numpy as np

from vlite.utils import group_offsets, group_starts


def test_group_starts_and_offsets():
    counts = np.array([2, 0, 3, 1])
    assert group_starts(counts).tolist() == [0, 2, 2, 5]
    assert group_offsets(counts).tolist() == [0, 1, 0, 1, 2, 0]
    assert group_starts([]).tolist() == [] and group_offsets([]).tolist() == []
    # the rows of each group: its start plus the offsets within it
    assert (np.repeat(group_starts(counts), counts) + group_offsets(counts)).tolist() == list(range(6))

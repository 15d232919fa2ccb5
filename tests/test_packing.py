from fpbench.packing import consecutive_chunks


def test_consecutive_items_fill_each_chunk_up_to_the_limit():
    assert consecutive_chunks([3, 2, 4, 1, 1], 5) == [[0, 1], [2, 3], [4]]


def test_an_item_over_the_limit_is_a_chunk_of_its_own():
    assert consecutive_chunks([7, 1, 6], 5) == [[0], [1], [2]]
    assert consecutive_chunks([], 5) == []

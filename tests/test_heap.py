"""settle_heap: what lives while an engine serves is hidden from the garbage collector (a full
collection over torch's objects stalls every request in flight), and what dies is still freed."""
import gc
import weakref

from angelspec.runtime import settle_heap


class Node:
    pass


def test_settle_heap_hides_the_living_and_still_frees_what_dies():
    try:
        a = Node()
        a.self = a  # a cycle: only the collector frees it
        ref = weakref.ref(a)
        settle_heap()
        assert gc.get_freeze_count() > 0
        del a
        gc.collect()
        assert ref() is not None  # hidden: a full collection passes it by
        settle_heap()
        assert ref() is None  # the next settle frees what died since the last
        b = Node()
        b.self = b
        ref_b = weakref.ref(b)
        del b
        gc.collect()
        assert ref_b() is None  # made after the settle: collected as usual
    finally:
        gc.unfreeze()

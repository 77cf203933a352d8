"""The page-id bookkeeping both batch runners' pools share (generation/page_ids.py), against a plain
dict of reference counts, and the same through each pool."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ktransformers.generation.page_ids import OutOfPages, PageIds
from ktransformers.server.reference_runner import PagePool as CountingPool

OPS = st.lists(st.tuples(st.sampled_from(["alloc", "reserve", "incref", "decref"]), st.integers(-1, 6)),
               max_size=60)


@settings(max_examples=150, deadline=None)
@given(num_pages=st.integers(1, 5), ops=OPS)
def test_counts_follow_a_dict_of_references(num_pages, ops):
    ids, refs = PageIds(num_pages), {}
    for op, x in ops:
        if op == "alloc":
            if len(refs) == num_pages:
                with pytest.raises(OutOfPages):
                    ids.alloc()
            else:
                p = ids.alloc()
                assert 0 <= p < num_pages and p not in refs
                refs[p] = 1
        elif op == "reserve":
            if x > num_pages - len(refs):
                with pytest.raises(OutOfPages):
                    ids.reserve(x)
            else:
                got = ids.reserve(x)
                assert len(got) == max(x, 0) and not set(got) & set(refs)
                refs.update(dict.fromkeys(got, 1))
        elif not 0 <= x < num_pages:
            with pytest.raises(ValueError, match="out of range"):
                getattr(ids, op)(x)
        elif x not in refs:
            with pytest.raises(ValueError, match="free"):
                getattr(ids, op)(x)
        elif op == "incref":
            ids.incref(x)
            refs[x] += 1
        else:
            ids.decref(x)
            refs[x] -= 1
            if refs[x] == 0:
                del refs[x]
        # a refused call changed nothing: the counts are the dict's after every call
        assert ids.used_count() == len(refs) and ids.free_count() == num_pages - len(refs)
        assert all(ids.refcount(p) == refs.get(p, 0) for p in range(num_pages))


def test_pressure_is_asked_for_the_shortfall_once():
    ids, asked = PageIds(3), []
    held = [ids.alloc(), ids.alloc()]

    def release(n):
        asked.append(n)
        ids.decref(held.pop())
        return 1

    ids.on_pressure = release
    assert len(ids.reserve(2)) == 2 and asked == [1]
    with pytest.raises(OutOfPages, match="need 2 pages, 1 of 3 free"):
        ids.reserve(2)  # the pressure releases one, not the two asked
    assert asked == [1, 2] and ids.free_count() == 1


def test_the_counting_pool_forgets_a_freed_pages_contents():
    import torch

    pool = CountingPool(2, 4)
    p = pool.alloc()
    pool.write_page(p, {"layers.0.key": torch.ones(4, 2)})
    pool.incref(p)
    pool.decref(p)
    assert torch.equal(pool.read_page(p)["layers.0.key"], torch.ones(4, 2))
    pool.decref(p)
    with pytest.raises(Exception, match="holds no K/V"):
        pool.read_page(p)
    with pytest.raises(ValueError, match="already free"):
        pool.decref(p)

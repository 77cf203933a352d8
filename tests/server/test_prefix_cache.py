"""PrefixCache over an in-test page pool: matching, chain keys, LRU per tier, spills, disk restarts
and bad files."""

from __future__ import annotations

import json
import logging
import os
import random

import pytest
import torch

from ktransformers.server.prefix_cache import (FILE_SUFFIX, PrefixCache, chain_root, page_keys, payload_nbytes)

from .prefix_fakes import FakePool, OutOfPages, expected_page, prefill, release

PS = 4
FP = "fp-test-model"


def toks(n, seed=0, lo=1, hi=500):
    r = random.Random(seed)
    return [r.randrange(lo, hi) for _ in range(n)]


def page_bytes(pool):
    return payload_nbytes(pool.read_page(0))


def run_request(cache: PrefixCache, pool: FakePool, tokens: list[int], insert=True):
    """What the engine does: match, prefill the rest, insert, release the sequence."""
    pages, n, tiers = cache.match(tokens)
    seq = prefill(pool, tokens, pages, n)
    for i in range(len(tokens) // PS):  # every full page holds what a cold prefill computes
        assert torch.equal(pool.storage[seq[i]], expected_page(pool, tokens, i)), f"page {i} differs"
    if insert:
        cache.insert(tokens, seq)
    release(pool, seq)
    return n, tiers


def test_longest_prefix_of_full_pages_leaving_one_token():
    pool = FakePool(32, PS)
    cache = PrefixCache(pool, fingerprint=FP, page_size=PS)
    a = toks(21)
    assert run_request(cache, pool, a) == (0, {"device": 0, "ram": 0, "disk": 0})
    assert cache.device_pages == 5
    assert run_request(cache, pool, a)[0] == 20          # 5 full pages, 1 token left to prefill
    assert run_request(cache, pool, a[:20], insert=False)[0] == 16   # must leave a token: 4 pages
    assert run_request(cache, pool, a[:4], insert=False)[0] == 0
    assert run_request(cache, pool, a[:5], insert=False)[0] == 4
    assert run_request(cache, pool, a[:10] + toks(9, seed=7), insert=False)[0] == 8
    assert run_request(cache, pool, toks(21, seed=3), insert=False)[0] == 0
    cache.clear_device()
    assert pool.free_count() == pool.num_pages  # nothing leaked


def test_a_page_key_depends_on_every_earlier_token():
    pool = FakePool(32, PS)
    cache = PrefixCache(pool, fingerprint=FP, page_size=PS)
    a = toks(13)
    run_request(cache, pool, a)
    b = [a[0] + 1] + a[1:]  # same pages 1.. but a different first token
    assert run_request(cache, pool, b, insert=False)[0] == 0
    root = chain_root(FP, PS)
    ka, kb = page_keys(root, a, PS, 3), page_keys(root, b, PS, 3)
    assert all(x != y for x, y in zip(ka, kb))
    assert page_keys(root, a, PS, 3) == ka  # deterministic
    assert page_keys(chain_root("other", PS), a, PS, 3)[0] != ka[0]
    assert page_keys(chain_root(FP, 8), a, 8, 1)[0] != page_keys(root, a, PS, 2)[1]


def test_multi_turn_reuses_previous_reply():
    pool = FakePool(64, PS)
    cache = PrefixCache(pool, fingerprint=FP, page_size=PS)
    prompt, reply, follow_up = toks(10, 1), toks(9, 2), toks(6, 3)
    run_request(cache, pool, prompt + reply)  # insert at finish: prompt + generated tokens
    n, tiers = run_request(cache, pool, prompt + reply + follow_up)
    assert n == 16 and tiers["device"] == 4   # (10 + 9) // 4 full pages of the first turn


def test_device_lru_releases_least_recent_chain_tail_first_and_skips_busy_pages():
    pool = FakePool(8, PS)
    cache = PrefixCache(pool, fingerprint=FP, page_size=PS)
    a, b = toks(12, 1), toks(12, 2)
    run_request(cache, pool, a)
    run_request(cache, pool, b)
    run_request(cache, pool, a)  # a is the most recent now
    pa = cache.match(a + [1])[0]  # a running request holds all of a's pages
    assert pool.free_count() == 2
    assert cache.release(1) == 1            # b's last page goes first
    assert run_request(cache, pool, b + [1], insert=False)[0] == 8
    assert cache.release(10) == 2           # only b's remaining pages: a's are busy
    assert run_request(cache, pool, a + [1], insert=False)[0] == 12
    release(pool, pa)
    cache.clear_device()
    assert pool.free_count() == pool.num_pages


def test_pool_pressure_releases_cached_pages_on_alloc():
    pool = FakePool(6, PS)
    cache = PrefixCache(pool, fingerprint=FP, page_size=PS)
    run_request(cache, pool, toks(24, 1))
    assert pool.free_count() == 0
    run_request(cache, pool, toks(24, 2))   # needs all 6 pages: the cache gives them back
    assert cache.device_pages == 6


def test_release_without_refcount_in_the_pool():
    pool = FakePool(6, PS, with_refcount=False)
    cache = PrefixCache(pool, fingerprint=FP, page_size=PS)
    a = toks(12, 1)
    run_request(cache, pool, a)
    held = cache.match(a + [1])[0]
    assert cache.release(3) == 0     # the pages stay in use: nothing was freed
    release(pool, held)
    assert pool.free_count() == pool.num_pages


def test_spill_device_to_ram_to_disk_with_byte_limits(tmp_path):
    pool = FakePool(16, PS)
    pb = page_bytes(pool)
    cache = PrefixCache(pool, fingerprint=FP, page_size=PS, ram_bytes=3 * pb, disk_dir=tmp_path,
                        disk_bytes=100 * pb)
    a = toks(21, 1)
    run_request(cache, pool, a)
    assert cache.clear_device() == 5
    cache.flush()  # files are written by a background thread
    st = cache.stats()["tiers"]
    assert st["ram"]["pages"] == 3 and st["ram"]["bytes"] <= 3 * pb
    assert st["disk"]["pages"] == 2 and len(list(tmp_path.glob("*" + FILE_SUFFIX))) == 2
    # the chain's head stays in RAM (evicted last), its tail went to disk
    n, tiers = run_request(cache, pool, a, insert=False)
    assert n == 20 and tiers == {"device": 0, "ram": 3, "disk": 2}
    st = cache.stats()["tiers"]
    assert st["ram"]["hits"] == 3 and st["disk"]["hits"] == 2 and st["ram"]["tokens"] == 12
    assert st["device"]["misses"] == 1 + 5  # the cold first request looked up one page
    # promoted pages are device pages again
    assert run_request(cache, pool, a, insert=False)[1] == {"device": 5, "ram": 0, "disk": 0}


def test_ram_only_lru_drops_oldest():
    pool = FakePool(16, PS)
    pb = page_bytes(pool)
    cache = PrefixCache(pool, fingerprint=FP, page_size=PS, ram_bytes=2 * pb)
    a, b = toks(9, 1), toks(9, 2)
    run_request(cache, pool, a)
    cache.clear_device()
    run_request(cache, pool, b)
    cache.clear_device()
    assert cache.stats()["tiers"]["ram"]["pages"] == 2
    assert run_request(cache, pool, a, insert=False)[0] == 0   # a was least recent: dropped
    assert run_request(cache, pool, b, insert=False)[1]["ram"] == 2


def test_disk_limit_evicts_least_recent_files(tmp_path):
    pool = FakePool(16, PS)
    cache = PrefixCache(pool, fingerprint=FP, page_size=PS, disk_dir=tmp_path, disk_bytes=1)
    run_request(cache, pool, toks(5, 1))
    cache.clear_device()
    cache.flush()
    assert next(tmp_path.glob("*" + FILE_SUFFIX), None) is None  # a page larger than the tier is not written
    cache2 = PrefixCache(FakePool(16, PS), fingerprint=FP, page_size=PS, disk_dir=tmp_path / "b",
                         disk_bytes=10 ** 9)
    run_request(cache2, cache2.pool, toks(5, 1))
    cache2.close()
    fsize = next((tmp_path / "b").glob("*" + FILE_SUFFIX)).stat().st_size
    pool = FakePool(16, PS)
    cache = PrefixCache(pool, fingerprint=FP, page_size=PS, disk_dir=tmp_path / "c", disk_bytes=int(2.5 * fsize))
    a, b = toks(9, 1), toks(9, 2)
    run_request(cache, pool, a)
    cache.clear_device()
    run_request(cache, pool, b)
    cache.clear_device()
    cache.flush()
    assert cache.stats()["tiers"]["disk"]["pages"] == 2
    assert cache.stats()["tiers"]["disk"]["bytes"] <= 2.5 * fsize
    assert len(list((tmp_path / "c").glob("*" + FILE_SUFFIX))) == 2
    assert run_request(cache, pool, b, insert=False)[1]["disk"] == 2
    assert run_request(cache, pool, a, insert=False)[0] == 0


def _spill_to_disk(tmp_path, tokens, fp=FP):
    pool = FakePool(16, PS)
    cache = PrefixCache(pool, fingerprint=fp, page_size=PS, disk_dir=tmp_path, disk_bytes=10 ** 9)
    run_request(cache, pool, tokens)
    cache.close()
    assert pool.free_count() == pool.num_pages
    files = sorted(tmp_path.glob("*" + FILE_SUFFIX))
    assert len(files) == len(tokens) // PS
    return files


def test_disk_hit_after_restart(tmp_path):
    a = toks(17, 5)
    _spill_to_disk(tmp_path, a)
    pool = FakePool(16, PS)  # a new process: new pool, new cache on the same folder
    cache = PrefixCache(pool, fingerprint=FP, page_size=PS, disk_dir=tmp_path, disk_bytes=10 ** 9)
    assert cache.stats()["tiers"]["disk"]["pages"] == 4
    n, tiers = run_request(cache, pool, a + [9], insert=False)   # checks every page's content
    assert n == 16 and tiers == {"device": 0, "ram": 0, "disk": 4}
    assert pool.writes == 4


def test_lru_order_survives_restart(tmp_path):
    pool = FakePool(16, PS)
    cache = PrefixCache(pool, fingerprint=FP, page_size=PS, disk_dir=tmp_path, disk_bytes=10 ** 9)
    a, b = toks(9, 1), toks(9, 2)
    run_request(cache, pool, a)
    run_request(cache, pool, b)
    cache.close()
    c2 = PrefixCache(FakePool(16, PS), fingerprint=FP, page_size=PS, disk_dir=tmp_path, disk_bytes=10 ** 9)
    run_request(c2, c2.pool, a, insert=False)  # a becomes the most recent, on disk too
    pb = next(tmp_path.glob("*" + FILE_SUFFIX)).stat().st_size
    c3 = PrefixCache(FakePool(16, PS), fingerprint=FP, page_size=PS, disk_dir=tmp_path, disk_bytes=2 * pb)
    assert run_request(c3, c3.pool, a, insert=False)[0] == 8
    assert run_request(c3, c3.pool, b, insert=False)[0] == 0


def _rewrite_header(data: bytes, edit) -> bytes:
    """The file with its JSON header passed through ``edit`` (the payload bytes unchanged)."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data[8 + n:]


def _retype(header):  # same byte count, other dtype: only the checksum can tell
    name = next(k for k in header if k != "__metadata__")
    header[name]["dtype"] = {"F32": "I32", "I32": "F32", "BF16": "F16", "F16": "BF16"}[header[name]["dtype"]]


def _shift_offsets(header):  # a tensor pointing past the end of the file
    name = next(k for k in header if k != "__metadata__")
    start, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [start + 10 ** 6, end + 10 ** 6]


def _old_version(header):
    header["__metadata__"]["format_version"] = "1"


HEADER_EDITS = {"retyped": _retype, "offsets_out_of_file": _shift_offsets, "old_format_version": _old_version}


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "empty", "garbage_header", "renamed",
                                    *HEADER_EDITS])
def test_bad_file_is_skipped_with_warning_and_deleted(tmp_path, caplog, damage):
    a = toks(13, 4)
    files = _spill_to_disk(tmp_path, a)
    keys = [k.hex() for k in page_keys(chain_root(FP, PS), a, PS, 3)]
    victim = tmp_path / f"{keys[1]}{FILE_SUFFIX}"
    data = victim.read_bytes()
    if damage == "flip_payload":
        data = data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:]
    elif damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "empty":
        data = b""
    elif damage == "garbage_header":
        data = (100).to_bytes(8, "little") + b"{not json" + b"x" * 200
    elif damage == "renamed":  # another page's valid file under this page's name
        data = (tmp_path / f"{keys[2]}{FILE_SUFFIX}").read_bytes()
    elif damage in HEADER_EDITS:
        data = _rewrite_header(data, HEADER_EDITS[damage])
    victim.write_bytes(data)
    pool = FakePool(16, PS)
    with caplog.at_level(logging.WARNING, logger="ktransformers.server"):
        cache = PrefixCache(pool, fingerprint=FP, page_size=PS, disk_dir=tmp_path, disk_bytes=10 ** 9)
        n, tiers = run_request(cache, pool, a, insert=False)
    assert n == 4 and tiers["disk"] == 1   # page 0 loads, page 1 is refused, the match stops there
    assert not victim.exists()
    assert any(victim.name in r.getMessage() and "deleting" in r.getMessage() for r in caplog.records)
    assert cache.stats()["dropped_files"] == 1
    assert files  # the other files stay
    assert (tmp_path / f"{keys[0]}{FILE_SUFFIX}").exists()


def test_foreign_fingerprint_files_are_deleted_and_never_loaded(tmp_path, caplog):
    a = toks(13, 4)
    _spill_to_disk(tmp_path, a, fp="another-model")
    (tmp_path / "notes.txt").write_text("not ours")
    (tmp_path / f".{'ab' * 16}{FILE_SUFFIX}.123.456.tmp").write_bytes(b"half")
    pool = FakePool(16, PS)
    with caplog.at_level(logging.WARNING, logger="ktransformers.server"):
        cache = PrefixCache(pool, fingerprint=FP, page_size=PS, disk_dir=tmp_path, disk_bytes=10 ** 9)
    assert cache.stats()["tiers"]["disk"]["pages"] == 0
    assert list(tmp_path.glob("*" + FILE_SUFFIX)) == []
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]   # an interrupted write's leftover is removed too
    assert sum("another model" in r.getMessage() for r in caplog.records) == 3
    assert run_request(cache, pool, a, insert=False)[0] == 0


def test_other_page_size_files_are_not_loaded(tmp_path):
    a = toks(17, 4)
    _spill_to_disk(tmp_path, a)
    cache = PrefixCache(FakePool(16, 8), fingerprint=FP, page_size=8, disk_dir=tmp_path, disk_bytes=10 ** 9)
    assert cache.stats()["tiers"]["disk"]["pages"] == 0


def test_out_of_pages_during_promotion_returns_a_shorter_match(tmp_path):
    a = toks(21, 6)
    pool = FakePool(8, PS)
    cache = PrefixCache(pool, fingerprint=FP, page_size=PS, ram_bytes=10 ** 9)
    run_request(cache, pool, a)
    cache.clear_device()
    busy = [pool.alloc() for _ in range(6)]  # other sequences hold 6 of the 8 pages
    pages, n, tiers = cache.match(a)
    assert n == 8 and tiers["ram"] == 2 and len(pages) == 2
    with pytest.raises(OutOfPages):
        pool.alloc()
    release(pool, pages)
    release(pool, busy)
    cache.clear_device()
    assert pool.free_count() == pool.num_pages


def test_stats_shape():
    pool = FakePool(8, PS)
    cache = PrefixCache(pool, fingerprint=FP, page_size=PS)
    a = toks(9)
    run_request(cache, pool, a)
    run_request(cache, pool, a, insert=False)
    s = cache.stats()
    assert s["lookups"] == 2 and s["lookup_tokens"] == 18 and s["matched_tokens"] == 8
    assert set(s["tiers"]) == {"device", "ram", "disk"}
    assert s["tiers"]["device"]["hits"] == 2 and s["tiers"]["device"]["pages"] == 2
    assert s["tiers"]["device"]["bytes"] == 2 * page_bytes(pool)


def test_uncounted_lookup_serves_pages_and_leaves_the_stats_alone():
    """``count=False`` (a request looked up again while it waits for pages): the same pages, RAM
    ones promoted as usual, and no counter moves."""
    pool = FakePool(8, PS)
    cache = PrefixCache(pool, fingerprint=FP, page_size=PS, ram_bytes=10 ** 9)
    a = toks(13, 3)
    run_request(cache, pool, a)
    cache.release(1)  # the chain's last page goes to RAM

    def counters():
        s = cache.stats()
        return ([s[k] for k in ("lookups", "lookup_tokens", "matched_tokens")],
                {t: [v["hits"], v["misses"], v["tokens"]] for t, v in s["tiers"].items()})

    before = counters()
    pages, n, tiers = cache.match(a, count=False)
    assert n == 12 and tiers == {"device": 2, "ram": 1, "disk": 0}
    for i, p in enumerate(pages):
        assert torch.equal(pool.storage[p], expected_page(pool, a, i))
    release(pool, pages)
    assert counters() == before
    pages, n, _ = cache.match(a)  # counted: all 3 pages on the device now
    release(pool, pages)
    (lookups, looked, matched), tiers = counters()
    assert [lookups, looked, matched] == [before[0][0] + 1, before[0][1] + 13, before[0][2] + 12]
    assert tiers["device"] == [before[1]["device"][0] + 3, before[1]["device"][1], before[1]["device"][2] + 12]


def test_bf16_pages_round_trip_through_disk(tmp_path):
    pool = FakePool(8, PS, dtype=torch.bfloat16)
    cache = PrefixCache(pool, fingerprint=FP, page_size=PS, disk_dir=tmp_path, disk_bytes=10 ** 9)
    a = toks(9, 8)
    pages = prefill(pool, a)
    cache.insert(a, pages)
    want = pool.storage[pages[0]].clone()
    release(pool, pages)
    cache.close()
    pool2 = FakePool(8, PS, dtype=torch.bfloat16)
    c2 = PrefixCache(pool2, fingerprint=FP, page_size=PS, disk_dir=tmp_path, disk_bytes=10 ** 9)
    got, n, _ = c2.match(a)
    assert n == 8 and torch.equal(pool2.storage[got[0]], want)


def test_close_writes_ram_and_device_tiers_to_disk(tmp_path):
    pool = FakePool(16, PS)
    cache = PrefixCache(pool, fingerprint=FP, page_size=PS, ram_bytes=10 ** 9, disk_dir=tmp_path,
                        disk_bytes=10 ** 9)
    a, b = toks(9, 1), toks(9, 2)
    run_request(cache, pool, a)
    cache.clear_device()            # a: RAM only
    run_request(cache, pool, b)     # b: device only
    assert cache.stats()["tiers"]["disk"]["pages"] == 0
    cache.close()
    assert pool.free_count() == pool.num_pages and pool.on_pressure is None
    c2 = PrefixCache(FakePool(16, PS), fingerprint=FP, page_size=PS, disk_dir=tmp_path, disk_bytes=10 ** 9)
    assert run_request(c2, c2.pool, a, insert=False)[1]["disk"] == 2
    assert run_request(c2, c2.pool, b, insert=False)[1]["disk"] == 2


def test_cache_limits_from_flags(tmp_path):
    from ktransformers.errors import ConfigError
    from ktransformers.server.prefix_cache import DEFAULT_RAM_GB, cache_limits

    assert cache_limits() == {"ram_bytes": int(DEFAULT_RAM_GB * 2**30), "disk_dir": None, "disk_bytes": 0}
    got = cache_limits(0.5, tmp_path / "kv", 2)
    assert got == {"ram_bytes": 2**29, "disk_dir": str(tmp_path / "kv"), "disk_bytes": 2 * 2**30}
    assert (tmp_path / "kv").is_dir()
    with pytest.raises(ConfigError, match="--prefix_cache_ram_gb"):
        cache_limits(-1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="--prefix_cache_dir .*not a directory"):
        cache_limits(1, tmp_path / "file", 1)


def test_disk_writes_leave_the_caller_and_pending_pages_still_hit(tmp_path, monkeypatch):
    import threading

    import ktransformers.server.prefix_cache as pc

    gate = threading.Event()
    real = pc.write_page_file

    def slow_write(*a, **kw):
        gate.wait(10)
        return real(*a, **kw)

    monkeypatch.setattr(pc, "write_page_file", slow_write)
    pool = FakePool(16, PS)
    cache = PrefixCache(pool, fingerprint=FP, page_size=PS, disk_dir=tmp_path, disk_bytes=10 ** 9)
    a = toks(9, 1)
    run_request(cache, pool, a)
    assert cache.clear_device() == 2             # returns while the writer waits
    assert cache.stats()["pending_writes"] == 2 and not list(tmp_path.glob("*" + FILE_SUFFIX))
    assert run_request(cache, pool, a, insert=False)[1]["disk"] == 2   # served from the pending copy
    gate.set()
    cache.close()
    assert len(list(tmp_path.glob("*" + FILE_SUFFIX))) == 2 and cache.stats()["pending_writes"] == 0


# ---- pictures: image tokens are keyed on their picture's content digest ----------------------------

PIC_A, PIC_B = bytes(range(32)), bytes(range(1, 33))  # two content digests (multimodal VisionInputs.spans)


def run_with_images(cache, pool, tokens, images, insert=True):
    pages, n, tiers = cache.match(tokens, images=images)
    seq = prefill(pool, tokens, pages, n)
    if insert:
        cache.insert(tokens, seq, images=images)
    release(pool, seq)
    return n, tiers


def test_image_pages_hit_only_the_same_picture_and_text_before_it_is_shared():
    pool = FakePool(64, PS)
    cache = PrefixCache(pool, fingerprint=FP, page_size=PS)
    t = toks(23, 6)  # a picture's tokens at 6..14: pages 1, 2, 3 hold image tokens, page 0 only text
    assert run_with_images(cache, pool, t, [(6, 15, PIC_A)])[0] == 0
    assert run_with_images(cache, pool, t, [(6, 15, PIC_A)], insert=False)[0] == 20   # all but the last token
    assert run_with_images(cache, pool, t, [(6, 15, PIC_B)], insert=False)[0] == 4    # stops before token 6
    assert run_with_images(cache, pool, t, None, insert=False)[0] == 4                # the same ids as text
    assert run_with_images(cache, pool, t, [(7, 15, PIC_A)], insert=False)[0] == 4    # the picture elsewhere
    # text first, then the same text with a picture from token 9 on: the text pages before it hit
    u = toks(23, 7)
    assert run_with_images(cache, pool, u, None)[0] == 0
    assert run_with_images(cache, pool, u, [(9, 15, PIC_A)], insert=False)[0] == 8
    # two pictures, the second one differs: the hit ends at the page holding its first token
    two = [(2, 6, PIC_A), (10, 14, PIC_A)]
    assert run_with_images(cache, pool, t, two)[0] == 0  # page 0 holds image tokens now
    assert run_with_images(cache, pool, t, two, insert=False)[0] == 20
    assert run_with_images(cache, pool, t, [(2, 6, PIC_A), (10, 14, PIC_B)], insert=False)[0] == 8
    root = chain_root(FP, PS)
    assert page_keys(root, t, PS, 5, [(6, 15, PIC_A)])[0] == page_keys(root, t, PS, 5)[0]
    assert all(x != y for x, y in zip(page_keys(root, t, PS, 5, [(6, 15, PIC_A)])[1:],
                                       page_keys(root, t, PS, 5, [(6, 15, PIC_B)])[1:]))
    cache.clear_device()
    assert pool.free_count() == pool.num_pages


def test_image_pages_survive_a_restart_on_disk_and_keep_their_picture(tmp_path, caplog):
    t = toks(17, 8)
    images = [(5, 11, PIC_A)]  # pages 1 and 2 hold image tokens
    pool = FakePool(16, PS)
    cache = PrefixCache(pool, fingerprint=FP, page_size=PS, disk_dir=tmp_path, disk_bytes=10 ** 9)
    run_with_images(cache, pool, t, images)
    cache.close()
    keys = [k.hex() for k in page_keys(chain_root(FP, PS), t, PS, 4, images)]
    meta = [json.loads((tmp_path / f"{k}{FILE_SUFFIX}").read_bytes()[8:][:int.from_bytes(
        (tmp_path / f"{k}{FILE_SUFFIX}").read_bytes()[:8], "little")])["__metadata__"] for k in keys]
    assert "salt" not in meta[0] and all("salt" in m for m in meta[1:3]) and "salt" not in meta[3]
    pool = FakePool(16, PS)
    cache = PrefixCache(pool, fingerprint=FP, page_size=PS, disk_dir=tmp_path, disk_bytes=10 ** 9)
    assert run_with_images(cache, pool, t, [(5, 11, PIC_B)], insert=False)[0] == 4
    # page 0 came to the device with the lookup above; the picture's pages come from disk
    assert run_with_images(cache, pool, t, images, insert=False) == (16, {"device": 1, "ram": 0, "disk": 3})
    cache.close()
    # an image page's file without its salt claims a key its tokens do not give: refused and deleted
    victim = tmp_path / f"{keys[1]}{FILE_SUFFIX}"

    def drop_salt(header):
        del header["__metadata__"]["salt"]
    victim.write_bytes(_rewrite_header(victim.read_bytes(), drop_salt))
    pool = FakePool(16, PS)
    with caplog.at_level(logging.WARNING, logger="ktransformers.server"):
        cache = PrefixCache(pool, fingerprint=FP, page_size=PS, disk_dir=tmp_path, disk_bytes=10 ** 9)
    assert not victim.exists() and any("key does not match" in r.getMessage() for r in caplog.records)
    assert run_with_images(cache, pool, t, images, insert=False)[0] == 4


@pytest.mark.parametrize("span, why", [((-1, 4, PIC_A), "image span"), ((4, 4, PIC_A), "image span"),
                                       ((5, 2, PIC_A), "image span"), ((0, 4, b""), "non-empty bytes digest"),
                                       ((0, 4, "ab"), "non-empty bytes digest")])
def test_bad_image_spans_are_one_line_errors(span, why):
    cache = PrefixCache(FakePool(8, PS), fingerprint=FP, page_size=PS)
    with pytest.raises(ValueError, match=why):
        cache.match(toks(9), images=[span])


def test_fuzz_image_spans_never_share_a_page_with_another_picture():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ktransformers.server.prefix_cache import image_salts

    root = chain_root(FP, PS)
    t = toks(40, 9)

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.tuples(st.integers(0, 39), st.integers(1, 12), st.binary(min_size=1, max_size=32)),
                    min_size=1, max_size=3), st.integers(0, 2), st.binary(min_size=1, max_size=32))
    def check(raw, which, other):
        spans = [(a, min(40, a + n), d) for a, n, d in raw]
        spans = [s for s in spans if s[0] < s[1]]
        if not spans:
            return
        which %= len(spans)
        a, b, d = spans[which]
        if other == d:
            return
        changed = list(spans)
        changed[which] = (a, b, other)
        k1, k2 = page_keys(root, t, PS, 10, spans), page_keys(root, t, PS, 10, changed)
        first = a // PS
        assert k1[:first] == k2[:first]            # pages before the changed picture are shared
        assert all(x != y for x, y in zip(k1[first:], k2[first:]))  # from its first token's page on, none
        salts = image_salts(spans, PS, 10)
        assert all(s == b"" for i, s in enumerate(salts)
                   if not any(x // PS <= i < -(-y // PS) for x, y, _ in spans))

    check()

    @settings(max_examples=100, deadline=None)
    @given(st.integers(-5, 50), st.integers(-5, 50), st.one_of(st.binary(max_size=4), st.text(max_size=4),
                                                              st.none(), st.integers()))
    def bad(a, b, d):
        if 0 <= a < b and isinstance(d, bytes) and d:
            return
        with pytest.raises(ValueError, match="image span"):
            image_salts([(a, b, d)], PS, 10)

    bad()

"""WeakIdMap: the identity-keyed map of the FSDP hooks' per-shard state."""

import gc

import torch

from dtensor_fp8.weak_id_map import WeakIdMap


def test_lookup_is_by_identity_not_equality():
    m = WeakIdMap()
    a, b = torch.zeros(2), torch.zeros(2)  # equal values, different objects
    m[a] = "a"
    assert m.get(a) == "a" and a in m
    assert m.get(b) is None and b not in m and m.get(b, "none") == "none"
    assert m.get_or_create(b, lambda: "b") == "b"
    assert m.get_or_create(b, lambda: "other") == "b"  # the factory runs for a new entry only
    assert len(m) == 2


def test_entry_goes_with_its_object():
    m = WeakIdMap()
    t = torch.ones(3)
    m[t] = {"plan": 1}
    del t
    gc.collect()
    assert len(m) == 0 and not m._entries


def test_a_reused_id_sees_no_stale_entry():
    m = WeakIdMap()
    for _ in range(200):  # CPython reuses the addresses (ids) of freed tensors
        t = torch.empty(1)
        assert m.get(t) is None, "a new object must not see the entry of a dead one with its id"
        m[t] = object()
        del t
    assert len(m) == 0


def test_overwrite_keeps_one_entry():
    m = WeakIdMap()
    t = torch.zeros(1)
    m[t] = 1
    m[t] = 2
    gc.collect()
    assert m.get(t) == 2 and len(m) == 1

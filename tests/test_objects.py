"""``ms_shm.objects``: looking at a user's object never raises, whatever its ``__getattr__`` does."""

from __future__ import annotations

import pytest

from ms_shm import objects


class Answers:
    present = 1

    def __init__(self, error):
        self.error = error

    def __getattr__(self, name):
        raise self.error(name)


@pytest.mark.parametrize("error", [AttributeError, KeyError, RuntimeError, ValueError])
def test_a_lookup_that_raises_is_missing(error):
    obj = Answers(error)
    assert objects.attribute(obj, "present") == 1 and objects.has(obj, "present")
    assert objects.attribute(obj, "absent", "default") == "default" and not objects.has(obj, "absent")


def test_an_attribute_whose_value_is_none_is_there():
    class Holder:
        value = None

    assert objects.has(Holder(), "value") and objects.attribute(Holder(), "value", 5) is None


class Unhashable:
    __hash__ = None

    def __eq__(self, other):
        return True  # equal to everything: only identity may match


def test_per_object_matches_by_identity_and_forgets_the_dead():
    memo = objects.PerObject()
    first, second = Unhashable(), Unhashable()
    memo.put(first, "k", 1)
    assert memo.get(first, "k") == 1 and memo.get(second, "k") is None and memo.get(first, "other", 7) == 7
    del first
    assert len(memo) == 0  # gone with its object: a new object at the same id finds nothing


def test_per_object_keeps_nothing_for_an_object_without_weak_references():
    memo = objects.PerObject()
    memo.put([1, 2], "k", 1)
    assert len(memo) == 0

"""LoRARequest: validation at the boundary, identity by lora_int_id."""

from __future__ import annotations

import pytest

from vlite.lora.request import LoRARequest


def test_fields_and_aliases() -> None:
    r = LoRARequest("sql", 3, "/adapters/sql")
    assert (r.name, r.adapter_id, r.path) == ("sql", 3, "/adapters/sql")


@pytest.mark.parametrize("args, field", [
    (("", 1, "/a"), "lora_name"),
    ((None, 1, "/a"), "lora_name"),
    (("a", 0, "/a"), "lora_int_id"),
    (("a", -2, "/a"), "lora_int_id"),
    (("a", 1.0, "/a"), "lora_int_id"),
    (("a", True, "/a"), "lora_int_id"),
    (("a", 1, ""), "lora_path"),
])
def test_invalid_fields_are_named(args: tuple, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LoRARequest(*args)


def test_identity_is_the_name() -> None:
    """As vLLM's LoRARequest: the same name is the same adapter, whatever its id or folder string."""
    a, same_name, other = LoRARequest("a", 1, "/a"), LoRARequest("a", 2, "/b"), LoRARequest("b", 1, "/a")
    assert a == same_name and hash(a) == hash(same_name)
    assert a != other
    assert len({a, same_name, other}) == 2
    assert a != "a"

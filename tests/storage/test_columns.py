"""The sink's column checks: a bad value is an InvalidMessage, which is a WireError."""

from __future__ import annotations

import pytest

from rankscope.protocol.errors import WireError
from rankscope.storage.columns import I32, InvalidMessage, int_field


def test_a_value_out_of_its_columns_range_is_a_wire_error_with_reason_and_detail():
    with pytest.raises(WireError) as e:
        int_field(2**31, "rank", I32)
    assert type(e.value) is InvalidMessage
    assert e.value.reason == "bad_body" and "rank=2147483648 out of range" in e.value.detail
    assert str(e.value) == f"bad_body: {e.value.detail}"
    assert str(InvalidMessage("bad_report")) == "bad_report" and InvalidMessage("bad_report").detail == ""

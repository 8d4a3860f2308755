"""Flight Recorder dumps as stored: the collective table and the layout PyTorch's analyzer needs."""

from __future__ import annotations

from rankscope.storage.fr_dumps import collective_states, with_group_configs


def entry(pg: str, desc: str, seq: int) -> dict:
    return {"process_group": [pg, desc], "collective_seq_id": seq, "record_id": seq}


DUMPS = {
    0: {"entries": [entry("0", "default_pg", 1), entry("1", "tp", 1)], "pg_config": {"": {"name": "", "ranks": "[0, 1]"}},
        "pg_status": {"0": {"last_enqueued_collective": 5, "last_started_collective": -1,
                            "last_completed_collective": "4"}}},
    1: {"entries": [entry("0", "default_pg", 1)], "pg_config": {},
        "pg_status": {"0": {"last_enqueued_collective": 4, "last_started_collective": -1,
                            "last_completed_collective": 4}, "junk": 3}},
}


def test_collective_states_are_one_row_per_rank_and_group() -> None:
    df = collective_states(DUMPS)
    assert df.values.tolist() == [[0, "0", 5, -1, 4], [1, "0", 4, -1, 4]]


def test_every_group_the_entries_name_gets_a_config_with_the_ranks_that_recorded_it() -> None:
    out = with_group_configs(DUMPS)
    assert out[1]["pg_config"]["0"] == {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}
    assert out[0]["pg_config"]["1"]["ranks"] == "[0]"
    assert out[0]["pg_config"][""] == DUMPS[0]["pg_config"][""]           # what the recorder had is kept
    assert "0" not in DUMPS[1]["pg_config"]                              # the input is not changed

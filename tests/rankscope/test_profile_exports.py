"""Profile exports read by their formats' readers: the pprof file by protobuf with pprof's
profile.proto schema (github.com/google/pprof, proto/profile.proto, built here as a descriptor),
the speedscope file by jsonschema with speedscope's file-format schema (its sampled-profile part,
transcribed from file-format-schema.json), and the differential by hand-computed numbers."""

from __future__ import annotations

import gzip

import jsonschema
import pandas as pd
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from rankscope import profiles
from rankscope.offline.exporters import folded_stacks, speedscope

PER_PATH = pd.DataFrame({
    "rank": [0, 0, 1, 1, 1],
    "path": ["train.py:1 main;model.py:10 forward", "train.py:1 main;torch/x.py:5 all_reduce",
             "train.py:1 main;model.py:10 forward", "train.py:1 main;data.py:30 augment", profiles.OTHER],
    "seconds": [6.0, 4.0, 6.0, 3.5, 0.5]})


def pprof_messages():
    """pprof's Profile message and the ones it uses, with profile.proto's field numbers and types."""
    f = descriptor_pb2.FileDescriptorProto(name="profile.proto", package="perftools.profiles", syntax="proto3")
    T = descriptor_pb2.FieldDescriptorProto

    def msg(name: str, *fields: tuple[str, int, int, str | None, bool]) -> None:
        m = f.message_type.add(name=name)
        for fname, num, ftype, type_name, repeated in fields:
            fd = m.field.add(name=fname, number=num, type=ftype,
                             label=T.LABEL_REPEATED if repeated else T.LABEL_OPTIONAL)
            if type_name:
                fd.type_name = f".perftools.profiles.{type_name}"

    M, I64, U64, S = T.TYPE_MESSAGE, T.TYPE_INT64, T.TYPE_UINT64, T.TYPE_STRING
    msg("Profile", ("sample_type", 1, M, "ValueType", True), ("sample", 2, M, "Sample", True),
        ("mapping", 3, M, "Mapping", True), ("location", 4, M, "Location", True),
        ("function", 5, M, "Function", True), ("string_table", 6, S, None, True), ("drop_frames", 7, I64, None, False),
        ("keep_frames", 8, I64, None, False), ("time_nanos", 9, I64, None, False),
        ("duration_nanos", 10, I64, None, False), ("period_type", 11, M, "ValueType", False),
        ("period", 12, I64, None, False), ("comment", 13, I64, None, True), ("default_sample_type", 14, I64, None, False))
    msg("ValueType", ("type", 1, I64, None, False), ("unit", 2, I64, None, False))
    msg("Sample", ("location_id", 1, U64, None, True), ("value", 2, I64, None, True), ("label", 3, M, "Label", True))
    msg("Label", ("key", 1, I64, None, False), ("str", 2, I64, None, False), ("num", 3, I64, None, False),
        ("num_unit", 4, I64, None, False))
    msg("Mapping", ("id", 1, U64, None, False), ("memory_start", 2, U64, None, False))
    msg("Location", ("id", 1, U64, None, False), ("mapping_id", 2, U64, None, False), ("address", 3, U64, None, False),
        ("line", 4, M, "Line", True), ("is_folded", 5, T.TYPE_BOOL, None, False))
    msg("Line", ("function_id", 1, U64, None, False), ("line", 2, I64, None, False))
    msg("Function", ("id", 1, U64, None, False), ("name", 2, I64, None, False), ("system_name", 3, I64, None, False),
        ("filename", 4, I64, None, False), ("start_line", 5, I64, None, False))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("perftools.profiles.Profile"))


def test_pprof_parses_with_pprofs_schema_and_holds_each_ranks_call_paths_leaf_first() -> None:
    Profile = pprof_messages()
    p = Profile.FromString(gzip.decompress(profiles.pprof(PER_PATH, time_ns=10**18, duration_ns=30 * 10**9)))
    s = list(p.string_table)
    assert s[0] == "" and s[p.sample_type[0].type] == "wall" and s[p.sample_type[0].unit] == "nanoseconds"
    assert p.time_nanos == 10**18 and p.duration_nanos == 30 * 10**9
    fn = {f.id: (s[f.name], s[f.filename], f.start_line) for f in p.function}
    loc = {lo.id: fn[lo.line[0].function_id] for lo in p.location}
    got = {}
    for smp in p.sample:
        (label,) = smp.label
        assert s[label.key] == "rank"
        got[(label.num, tuple(loc[i][0] for i in smp.location_id))] = smp.value[0]
    assert got == {(0, ("forward", "main")): 6 * 10**9, (0, ("all_reduce", "main")): 4 * 10**9,
                   (1, ("forward", "main")): 6 * 10**9, (1, ("augment", "main")): 3_500_000_000}
    assert ("augment", "data.py", 30) in fn.values()


# speedscope's file format (https://www.speedscope.app/file-format-schema.json), the parts a sampled
# profile uses, as its published JSON schema states them.
SPEEDSCOPE = {
    "$schema": "http://json-schema.org/draft-06/schema#",
    "definitions": {
        "Frame": {"type": "object", "properties": {"name": {"type": "string"}, "file": {"type": "string"},
                                                   "line": {"type": "number"}, "col": {"type": "number"}},
                  "required": ["name"]},
        "ValueUnit": {"type": "string", "enum": ["bytes", "microseconds", "milliseconds", "nanoseconds", "none",
                                                 "seconds"]},
        "SampledProfile": {"type": "object", "properties": {
            "type": {"type": "string", "enum": ["sampled"]}, "name": {"type": "string"},
            "unit": {"$ref": "#/definitions/ValueUnit"}, "startValue": {"type": "number"},
            "endValue": {"type": "number"},
            "samples": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
            "weights": {"type": "array", "items": {"type": "number"}}},
            "required": ["endValue", "name", "samples", "startValue", "type", "unit", "weights"]}},
    "type": "object",
    "properties": {"$schema": {"type": "string", "enum": ["https://www.speedscope.app/file-format-schema.json"]},
                   "shared": {"type": "object", "properties": {
                       "frames": {"type": "array", "items": {"$ref": "#/definitions/Frame"}}}, "required": ["frames"]},
                   "profiles": {"type": "array", "items": {"$ref": "#/definitions/SampledProfile"}},
                   "name": {"type": "string"}, "activeProfileIndex": {"type": "number"}, "exporter": {"type": "string"}},
    "required": ["$schema", "profiles", "shared"]}


def test_speedscope_and_folded_exports_of_a_profile() -> None:
    fns = profiles.as_functions(PER_PATH)
    doc = speedscope(fns, "job")
    jsonschema.Draft6Validator(SPEEDSCOPE).validate(doc)
    frames = [f["name"] for f in doc["shared"]["frames"]]
    rank1 = next(p for p in doc["profiles"] if p["name"] == "rank 1")
    paths = {tuple(frames[i] for i in smp): w for smp, w in zip(rank1["samples"], rank1["weights"], strict=True)}
    assert paths[("train.py:1 main", "data.py:30 augment")] == 3_500_000_000
    assert "rank_1;train.py:1_main;data.py:30_augment 3500000" in folded_stacks(fns).splitlines()


def test_the_differential_ranks_what_a_rank_does_more_than_its_peers_median() -> None:
    per = pd.concat([PER_PATH, pd.DataFrame({"rank": [2, 2], "path": ["train.py:1 main;model.py:10 forward",
                                                                     "train.py:1 main;torch/x.py:5 all_reduce"],
                                             "seconds": [6.0, 4.5]})])
    diff = profiles.differential(per, [1])
    assert diff.iloc[0].to_dict() == {"path": "train.py:1 main;data.py:30 augment", "function": "data.py:30 augment",
                                      "target_s": 3.5, "peers_median_s": 0.0, "added_s": 3.5}
    assert diff.iloc[-1]["function"] == "torch/x.py:5 all_reduce" and diff.iloc[-1]["added_s"] == -4.25
    nodes = profiles.differential_nodes(per, [1]).set_index("node")
    assert nodes.loc[[("train.py:1 main",)], "added_s"].iloc[0] == 9.5 - 10.25


def test_the_differential_names_a_grown_path_where_it_leaves_what_the_peers_run() -> None:
    # Rank 1 runs the peers' compute again from a function of its own, while they wait for it: that
    # function names the path. Wall-clock samples: every rank was seen for the same 13 s.
    peers = [(r, p, s) for r in (0, 2, 3) for p, s in (("main;step;compute", 6.0), ("main;step;wait", 7.0))]
    per = pd.DataFrame(peers + [(1, "main;step;compute", 6.0), (1, "main;augment;compute", 7.0)],
                       columns=["rank", "path", "seconds"])
    diff = profiles.differential(per, [1])
    assert diff.iloc[0]["path"] == "main;augment;compute" and diff.iloc[0]["function"] == "augment"
    # The same code run longer keeps its innermost frame.
    longer = pd.DataFrame(peers + [(1, "main;step;compute", 12.0), (1, "main;step;wait", 1.0)],
                          columns=["rank", "path", "seconds"])
    assert profiles.differential(longer, [1]).iloc[0]["function"] == "compute"

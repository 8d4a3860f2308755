-- rankscope ClickHouse schema. Applied idempotently at start-up by storage.store.apply_schema().
-- Statements are separated by lines holding only ';'. {db} is replaced by the database name.
-- Times are Int64 nanoseconds since the Unix epoch (host wall clock); `ts` columns are derived
-- DateTime64 columns for humans and Grafana. Re-inserts are idempotent: ReplacingMergeTree keyed
-- by the record's identity (queries that must be exact use FINAL or argMax).

CREATE DATABASE IF NOT EXISTS {db}
;
CREATE TABLE IF NOT EXISTS {db}.schema_migrations
(
    version UInt32,
    name String,
    applied_at DateTime64(3) DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree
ORDER BY version
;
CREATE TABLE IF NOT EXISTS {db}.jobs
(
    job LowCardinality(String),
    world_size Int32,
    first_seen_ns Int64,
    last_seen_ns Int64,
    first_seen DateTime64(3) MATERIALIZED fromUnixTimestamp64Nano(first_seen_ns),
    last_seen DateTime64(3) MATERIALIZED fromUnixTimestamp64Nano(last_seen_ns)
)
ENGINE = ReplacingMergeTree(last_seen_ns)
ORDER BY job
;
CREATE TABLE IF NOT EXISTS {db}.ranks
(
    job LowCardinality(String),
    rank Int32,
    host LowCardinality(String),
    pid Int32,
    local_rank Int32,
    world_size Int32,
    last_step Int64,
    last_seen_ns Int64,
    exit_reason LowCardinality(String),
    exit_detail String
)
ENGINE = ReplacingMergeTree(last_seen_ns)
ORDER BY (job, rank)
;
CREATE TABLE IF NOT EXISTS {db}.steps
(
    job LowCardinality(String),
    rank Int32,
    step Int64,
    start_ns Int64,
    end_ns Int64,
    duration_ns Int64,
    comm_ns Int64,
    busy_ns Int64,
    host LowCardinality(String),
    pid Int32,
    seq Int64,
    ts DateTime64(3) MATERIALIZED fromUnixTimestamp64Nano(end_ns)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(fromUnixTimestamp64Nano(end_ns))
ORDER BY (job, rank, step, pid)
;
CREATE TABLE IF NOT EXISTS {db}.heartbeats
(
    job LowCardinality(String),
    rank Int32,
    ts_ns Int64,
    step Int64,
    since_step_s Float64,
    dropped Int64,
    host LowCardinality(String),
    pid Int32,
    seq Int64,
    stacks String,
    ts DateTime64(3) MATERIALIZED fromUnixTimestamp64Nano(ts_ns)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(fromUnixTimestamp64Nano(ts_ns))
ORDER BY (job, rank, ts_ns, pid)
TTL toDateTime(fromUnixTimestamp64Nano(ts_ns)) + INTERVAL {ttl:heartbeats} DAY
SETTINGS ttl_only_drop_parts = 1
;
CREATE TABLE IF NOT EXISTS {db}.worker_stats
(
    job LowCardinality(String),
    rank Int32,
    ts_ns Int64,
    step Int64,
    window_steps Int32,
    median_step_ns Int64,
    p95_step_ns Int64,
    median_busy_ns Int64,
    median_comm_ns Int64,
    busy_z Float64,
    state LowCardinality(String),
    ts DateTime64(3) MATERIALIZED fromUnixTimestamp64Nano(ts_ns)
)
ENGINE = ReplacingMergeTree
ORDER BY (job, rank, ts_ns)
;
CREATE TABLE IF NOT EXISTS {db}.alerts
(
    alert_id String,
    job LowCardinality(String),
    kind LowCardinality(String),
    status LowCardinality(String),
    severity LowCardinality(String),
    ranks Array(Int32),
    step Int64,
    opened_ns Int64,
    updated_ns Int64,
    resolved_ns Int64,
    version UInt32,
    summary String,
    lost_rank_seconds Float64,
    body String,
    ts DateTime64(3) MATERIALIZED fromUnixTimestamp64Nano(updated_ns)
)
ENGINE = ReplacingMergeTree(version)
ORDER BY (job, alert_id)
;
CREATE TABLE IF NOT EXISTS {db}.alert_events
(
    alert_id String,
    job LowCardinality(String),
    kind LowCardinality(String),
    status LowCardinality(String),
    version UInt32,
    updated_ns Int64,
    body String
)
ENGINE = ReplacingMergeTree
ORDER BY (job, alert_id, version)
;
CREATE TABLE IF NOT EXISTS {db}.deadletters
(
    ts_ns Int64,
    source_topic LowCardinality(String),
    partition Int32,
    offset Int64,
    stage LowCardinality(String),
    reason LowCardinality(String),
    detail String,
    payload_b64 String
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(fromUnixTimestamp64Nano(ts_ns))
ORDER BY (source_topic, partition, offset, stage)
TTL toDateTime(fromUnixTimestamp64Nano(ts_ns)) + INTERVAL {ttl:deadletters} DAY
SETTINGS ttl_only_drop_parts = 1
;
CREATE TABLE IF NOT EXISTS {db}.hw_samples
(
    job LowCardinality(String),
    rank Int32,
    host LowCardinality(String),
    device Int32,
    ts_ns Int64,
    metric LowCardinality(String),
    value Float64,
    ts DateTime64(3) MATERIALIZED fromUnixTimestamp64Nano(ts_ns)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(fromUnixTimestamp64Nano(ts_ns))
ORDER BY (job, host, device, metric, ts_ns)
TTL toDateTime(fromUnixTimestamp64Nano(ts_ns)) + INTERVAL {ttl:hw_samples} DAY
SETTINGS ttl_only_drop_parts = 1
;
CREATE TABLE IF NOT EXISTS {db}.trace_windows
(
    job LowCardinality(String),
    window_id String,
    rank Int32,
    status LowCardinality(String),
    first_step Int64,
    last_step Int64,
    start_ns Int64,
    end_ns Int64,
    events Int64,
    truncated UInt8,
    updated_ns Int64
)
ENGINE = ReplacingMergeTree(updated_ns)
ORDER BY (job, window_id, rank)
;
CREATE TABLE IF NOT EXISTS {db}.trace_events
(
    job LowCardinality(String),
    window_id String,
    rank Int32,
    category LowCardinality(String),
    name LowCardinality(String),
    start_ns Int64,
    dur_ns Int64,
    device Int32,
    stream Int32,
    step Int64,
    bytes Int64,
    attrs Map(LowCardinality(String), String),
    -- Kineto's launch links (rankscope.protocol.trace_rows.launch_ids); -1: none, or sent by an older rank.
    correlation Int64 DEFAULT -1,
    external_id Int64 DEFAULT -1
)
ENGINE = MergeTree
PARTITION BY toYYYYMMDD(fromUnixTimestamp64Nano(start_ns))
ORDER BY (job, window_id, rank, start_ns)
TTL toDateTime(fromUnixTimestamp64Nano(start_ns)) + INTERVAL {ttl:trace_events} DAY
SETTINGS ttl_only_drop_parts = 1
;
CREATE TABLE IF NOT EXISTS {db}.function_summaries
(
    job LowCardinality(String),
    window_id String,
    rank Int32,
    category LowCardinality(String),
    name String,
    count Int64,
    total_ns Int64,
    median_ns Int64,
    p95_ns Int64,
    max_ns Int64,
    exclusive_ns Int64,
    window_ns Int64
)
ENGINE = ReplacingMergeTree
ORDER BY (job, window_id, rank, category, name)
;
CREATE TABLE IF NOT EXISTS {db}.reports
(
    job LowCardinality(String),
    window_id String,
    created_ns Int64,
    body String
)
ENGINE = ReplacingMergeTree(created_ns)
ORDER BY (job, window_id)
;
-- Each rank's PyTorch Flight Recorder dump (its collectives by process group and sequence number,
-- with their states and times), as the recorder's JSON, sent with the rank's flight record on a hang
-- or a request; `rankscope export --fr-dump` writes them as PyTorch's fr_trace analyzer reads them.
CREATE TABLE IF NOT EXISTS {db}.fr_dumps
(
    job LowCardinality(String),
    rank Int32,
    ts_ns Int64,
    request_id String,
    reason String,
    host LowCardinality(String),
    pid Int32,
    truncated UInt8,
    dump String CODEC(ZSTD(3)),
    ts DateTime64(3) MATERIALIZED fromUnixTimestamp64Nano(ts_ns)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(fromUnixTimestamp64Nano(ts_ns))
ORDER BY (job, request_id, rank, ts_ns)
TTL toDateTime(fromUnixTimestamp64Nano(ts_ns)) + INTERVAL {ttl:fr_dumps} DAY
SETTINGS ttl_only_drop_parts = 1
;
-- Each rank's sampled Python stacks (producers/stack_sampler.py): per interval, thread role and call
-- path ("root;...;leaf", user frames only) its sample count; path "" counts the role's samples that
-- left the message. Seconds spent = samples / hz. A DataLoader worker's rows carry its own pid.
CREATE TABLE IF NOT EXISTS {db}.profile_samples
(
    job LowCardinality(String),
    rank Int32,
    host LowCardinality(String),
    pid Int32,
    ts_ns Int64,
    interval_ns Int64,
    role LowCardinality(String),
    path String CODEC(ZSTD(3)),
    -- The path as a hash, for sums per path that do not read the paths' text (migration 0002).
    path_hash UInt64 MATERIALIZED cityHash64(path),
    samples UInt32,
    hz Float32,
    ts DateTime64(3) MATERIALIZED fromUnixTimestamp64Nano(ts_ns)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(fromUnixTimestamp64Nano(ts_ns))
ORDER BY (job, rank, ts_ns, pid, role, path)
TTL toDateTime(fromUnixTimestamp64Nano(ts_ns)) + INTERVAL {ttl:profile_samples} DAY
SETTINGS ttl_only_drop_parts = 1
;
-- The tool's own flight records, which a rank sends when an alert or a control message asks (last
-- step records [step, start_ns, end_ns, comm_ns] and every thread's stack, both as JSON).
CREATE TABLE IF NOT EXISTS {db}.flight_records
(
    job LowCardinality(String),
    rank Int32,
    ts_ns Int64,
    request_id String,
    reason String,
    host LowCardinality(String),
    pid Int32,
    steps String,
    stacks String,
    ts DateTime64(3) MATERIALIZED fromUnixTimestamp64Nano(ts_ns)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(fromUnixTimestamp64Nano(ts_ns))
ORDER BY (job, rank, ts_ns)
TTL toDateTime(fromUnixTimestamp64Nano(ts_ns)) + INTERVAL {ttl:flight_records} DAY
SETTINGS ttl_only_drop_parts = 1
;

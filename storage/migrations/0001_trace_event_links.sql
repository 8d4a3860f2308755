-- Kineto's launch links of each trace event (correlation: runtime call <-> GPU work; external_id:
-- op <-> launch), so an export of a stored window draws launch -> kernel flows. -1: none.
ALTER TABLE {db}.trace_events
    ADD COLUMN IF NOT EXISTS correlation Int64 DEFAULT -1,
    ADD COLUMN IF NOT EXISTS external_id Int64 DEFAULT -1
;

-- Each profile row's call path as a 64-bit hash (cityHash64(path)), computed at insert: the dashboard
-- sums a job's samples per path over this column and reads each distinct path's text once, instead of
-- reading every row's path (a 60 s job of 10,000 ranks holds ~1 GB of path text). Rows stored before
-- this migration compute it when read.
ALTER TABLE {db}.profile_samples
    ADD COLUMN IF NOT EXISTS path_hash UInt64 MATERIALIZED cityHash64(path) AFTER path
;

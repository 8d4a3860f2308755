-- Each rank's CPU wait share: of the time in its last 30 s its training thread was ready to run, the
-- share it was runnable but waiting for a CPU (rankscope/protocol/stats.py cpu_wait); -1 where the
-- rank does not report it, and in rows stored before this migration.
ALTER TABLE {db}.worker_stats
    ADD COLUMN IF NOT EXISTS cpu_wait_share Float64 DEFAULT -1 AFTER busy_z
;

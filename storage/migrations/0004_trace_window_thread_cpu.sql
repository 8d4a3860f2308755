-- Each rank's training thread over a trace window: its time on a CPU and its run-queue wait
-- (runnable, waiting for a CPU), in ns, as the rank's summary sends them (rankscope/protocol/trace_summary.py
-- thread_cpu); -1 where the rank does not send them, and in rows stored before this migration.
ALTER TABLE {db}.trace_windows
    ADD COLUMN IF NOT EXISTS thread_cpu_ns Int64 DEFAULT -1 AFTER truncated
;
ALTER TABLE {db}.trace_windows
    ADD COLUMN IF NOT EXISTS thread_runq_ns Int64 DEFAULT -1 AFTER thread_cpu_ns
;

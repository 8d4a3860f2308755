"""After ``fork()`` (DataLoader workers) the child's transport is inert and never destroys the
parent's librdkafka handle: the child has its memory but none of its threads, and destroying it
there made every forked child wait about 1 s at exit."""

from __future__ import annotations

import gc
import os
import weakref

import rankscope.producers.transport as transport_mod
from rankscope.producers.transport import Transport


def test_forked_child_keeps_the_parents_producer_undestroyed_and_sends_nothing():
    t = Transport("127.0.0.1:1", queue_max=10)
    producer = t._producer
    assert producer is not None
    pid = os.fork()
    if pid == 0:   # the child: report through the exit code, never run pytest's teardown
        ok = (t._producer is None and any(h is producer for h in transport_mod._FORKED_HANDLES)
              and None not in transport_mod._FORKED_HANDLES and t.send("x", b"k", b"v") is False)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    t.close(0.5)
    assert os.waitstatus_to_exitcode(status) == 0
    assert transport_mod._FORKED_HANDLES == []     # the parent keeps nothing
    assert t._producer is None                     # closed: librdkafka released


def test_a_closed_transport_is_not_kept_alive_by_its_fork_handler():
    t = Transport("127.0.0.1:1", queue_max=10)
    t.close(0.1)
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None

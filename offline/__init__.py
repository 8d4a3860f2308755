"""Offline analysis of recorded Kineto trace files: the reader, breakdowns, HTA conventions,
exports and replay. It shares the pure analyzers of ``rankscope.stream_processors.analysis`` with the
live processors, which never import this package."""

"""Logging helpers of the daemon's processes (``hydrad.logs``)."""

from __future__ import annotations

import logging

from hydrad.logs import REQUESTS_LOGGER, RepeatedLines, configure_logging


def test_repeated_lines_log_a_burst_per_window_and_say_how_many_were_left_out():
    now = [0.0]
    lines = RepeatedLines(burst=3, window=10.0, clock=lambda: now[0])
    assert [lines.admit("503") for _ in range(5)] == [(True, 0)] * 3 + [(False, 0)] * 2
    assert lines.admit("400") == (True, 0)  # another kind has its own burst
    now[0] = 9.9
    assert lines.admit("503") == (False, 0)
    now[0] = 10.0  # a new window: its first line says how many the last one left out
    assert lines.admit("503") == (True, 3)
    assert lines.admit("503") == (True, 0)
    now[0] = 30.0
    assert lines.admit("503") == (True, 0)  # nothing was left out


def test_the_line_per_finished_request_follows_log_requests():
    logger = logging.getLogger(REQUESTS_LOGGER)
    try:
        configure_logging("info", log_requests=False)
        assert not logger.isEnabledFor(logging.INFO) and logger.isEnabledFor(logging.WARNING)
        configure_logging("info", log_requests=True)
        assert logger.level == logging.NOTSET
    finally:
        logger.setLevel(logging.NOTSET)

"""AcceptBackoff (kvplugins/security/limits.py): the log line a failing accept() leaves is rate-limited per
errno, so a second cause (EMFILE after an ENOBUFS) is never hidden behind the first one's interval."""

import errno
import logging
import os

from kvplugins.security.limits import AcceptBackoff


def _err(code: int) -> OSError:
    return OSError(code, os.strerror(code))


def test_each_errno_logs_its_own_line_and_repeats_are_counted(caplog):
    backoff = AcceptBackoff("test endpoint", log_interval_s=3600)
    with caplog.at_level(logging.WARNING, logger="kvplugins.security"):
        pauses = [
            backoff.failed(_err(errno.ENOBUFS)),
            backoff.failed(_err(errno.EMFILE)),
            backoff.failed(_err(errno.EMFILE)),
            backoff.failed(_err(errno.EMFILE)),
        ]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "accept failed (No buffer space available)" in lines[0]
    assert "accept failed (Too many open files)" in lines[1]
    assert backoff.failures == 4
    assert pauses == [0.01, 0.02, 0.04, 0.08]  # doubles while failures go on, whatever the errno
    backoff.ok()
    assert backoff.failed(_err(errno.EMFILE)) == 0.01  # a success resets the pause, not the log interval
    assert len(caplog.records) == 2


def test_hidden_failures_are_reported_on_the_next_line(caplog):
    backoff = AcceptBackoff("test endpoint", log_interval_s=0.0)
    with caplog.at_level(logging.WARNING, logger="kvplugins.security"):
        backoff.failed(_err(errno.EMFILE))
    assert "more since the last line" not in caplog.records[-1].getMessage()
    backoff.log_interval_s = 3600
    backoff.failed(_err(errno.EMFILE))
    backoff.failed(_err(errno.EMFILE))
    backoff.log_interval_s = 0.0
    with caplog.at_level(logging.WARNING, logger="kvplugins.security"):
        backoff.failed(_err(errno.EMFILE))
    assert "(2 more since the last line)" in caplog.records[-1].getMessage()

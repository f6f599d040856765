"""Imported first by the apps that tests start as worker processes: ``PGQUEUE_TEST_CLOCK_OFFSET``
skews the process's wall clock (time.time and datetime.now) by that many seconds, as on a badly
synced host. pgqueue must decide leases, retries and schedules by the database clock anyway."""

from __future__ import annotations

import datetime as _dt
import os
import time

_OFFSET = float(os.environ.get("PGQUEUE_TEST_CLOCK_OFFSET", "0"))
if _OFFSET:
    _real_time = time.time

    def _skewed_time() -> float:
        return _real_time() + _OFFSET

    class _SkewedDatetime(_dt.datetime):
        @classmethod
        def now(cls, tz: _dt.tzinfo | None = None) -> _SkewedDatetime:
            return cls.fromtimestamp(_skewed_time(), tz)

    time.time = _skewed_time
    _dt.datetime = _SkewedDatetime  # type: ignore[misc]

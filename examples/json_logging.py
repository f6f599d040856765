"""JSON logs with the standard library only: one object per line, with the job's fields.

``pgqueue.JobLogFilter`` puts ``job_id``, ``task``, ``queue`` and ``attempt`` on every record
written while a job runs; this formatter writes them (and any other ``extra=``) as JSON.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

import pgqueue

#: What every LogRecord has: not "extra" fields.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        # job_id, task, queue, attempt during a job, and whatever else came as extra=...
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(level: int = logging.INFO) -> logging.Handler:
    """Log JSON lines to stderr, each record written during a job naming it."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    handler.addFilter(pgqueue.JobLogFilter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    return handler

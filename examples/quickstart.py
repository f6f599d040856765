"""The Getting started page's first task.

export PGQUEUE_DSN=postgresql://localhost/mydb
pgqueue migrate
python -c "from quickstart import greet; print(greet.enqueue(name='Ada'))"
pgqueue worker --app quickstart:app
"""

from __future__ import annotations

import pgqueue

app = pgqueue.App()  # the DSN comes from $PGQUEUE_DSN (or $DATABASE_URL)


@app.task(queue="greetings", max_attempts=3)
def greet(name: str) -> str:
    """Runs in a worker. The return value is stored as the job's result (JSON)."""
    return f"Hello, {name}!"

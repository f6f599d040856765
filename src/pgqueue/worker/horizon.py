"""Says which transaction is slowing the claims, once, and once more when they are fast again.

A session that keeps a snapshot open (``BEGIN; SELECT ...;`` then idle, a long report, a
forgotten console) stops vacuum from removing the row versions that claims and acks leave behind,
and a claim that reads its index from the start walks all of them: it slows by the minute. The
fetcher then claims from where its last claim ended (``claim_jobs_after``), which keeps claims
fast, but the cause is someone else's and only an operator can end it: so the worker names it,
with what the dashboard's health strip shows (pid, application_name, state, age), in one warning
when claims have turned slow and such a transaction exists, and one line when claims are fast
again. Looking costs a pass over ``pg_stat_activity``: at most every ``LOOK_EVERY`` seconds, and
only while claims are slow.
"""

from __future__ import annotations

import logging

from ..sql import Queries
from .connections import Connections

log = logging.getLogger("pgqueue.worker.fetcher")

#: A transaction holding back vacuum is named only once it is at least this old (seconds): a
#: claim can be slow for a moment for other reasons, with every transaction short.
OLDER_THAN = 10.0
#: Seconds between looks at pg_stat_activity while claims stay slow and nothing was named.
LOOK_EVERY = 30.0


class HorizonWatch:
    def __init__(self, pool: Connections, q: Queries) -> None:
        self.pool = pool
        self.q = q
        #: The transaction named in the warning (pid), until claims are fast again.
        self.named: int | None = None
        self._looked = -LOOK_EVERY

    async def claims_slow(self, seconds: float, now: float) -> None:
        """A claim from the start of the index took ``seconds``: name the transaction that
        holds back vacuum, if one does and none was named yet (``now``: the loop's clock)."""
        if self.named is not None or now - self._looked < LOOK_EVERY:
            return
        self._looked = now
        try:
            async with self.pool.connection() as conn:
                cur = await conn.execute(self.q.vacuum_horizon_holder, {"older_than": OLDER_THAN})
                row = await cur.fetchone()
        except Exception as exc:  # a diagnosis only: the claims go on either way
            log.debug("could not look for a transaction holding back vacuum (%s)", exc)
            return
        if row is None:
            return
        pid, application, state, age = row
        self.named = int(pid)
        log.warning(
            "claims slowed to %.0f ms: the transaction of pid %d (application_name %r, %s) has "
            "held back vacuum for %.0f s, so the rows that claims and acks leave behind pile up; "
            "claims now start where the last one ended, but end that transaction "
            "(SELECT pg_terminate_backend(%d)) or set idle_in_transaction_session_timeout",
            seconds * 1000, pid, application or "", state, age, pid,
        )  # fmt: skip

    def claims_fast(self) -> None:
        """A claim from the start of the index was fast again: say so once, if a transaction
        was named."""
        if self.named is None:
            return
        log.info("claims are fast again: vacuum is no longer held back (pid %d was named)",
                 self.named)  # fmt: skip
        self.named = None
        self._looked = -LOOK_EVERY

"""The usage ledger: one row per request, durable before the response ends.

* :mod:`.ledger`: :class:`~.ledger.UsageLedger`, one admitted request's counts until its row
  is written (exactly once) and its rate-limit ticket released.
* :mod:`.records`: :class:`~.records.UsageRecord`, its rows in the database (``usage_events``)
  and the per-tenant summary ``GET /v1/usage`` answers.
* :mod:`.spool`: the append-only spool file a record reaches first.
* :mod:`.commit`: the group commit that makes spool writes durable together.
* :mod:`.writer`: :class:`~.writer.UsageWriter`, spool then database, with the dead letter.

The table's model is in ``gateway.db.models`` with the others (one schema, one migration
history); the HTTP face is ``gateway.domains.usage``. docs/usage.md describes the ledger.
"""

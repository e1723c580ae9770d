"""Use cases over an ``AsyncSession``: tenants, keys, usage.

Services flush but never commit: the caller owns the transaction (a Litestar request's session,
or ``async with session.begin():`` in the CLI), so a failure part-way leaves nothing behind.
"""

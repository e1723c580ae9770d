"""``python -m bench.hostile``: the hostile-client workload against a live ``loraplex serve``.

Each part lives in its own module and returns a dict of figures; ``__main__`` runs them in turn
against servers started by :class:`bench.hostile.live.LiveServer` and prints the table and the
JSON line (issue 13's figures).
"""

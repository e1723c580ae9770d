"""The gateway's Prometheus metrics (docs/metrics.md).

* :mod:`.registry`: :class:`~.registry.GatewayMetrics`, the registry and its counters.
* :mod:`.latency`: the per-model latency histograms (time to first token, inter-token,
  end-to-end, queue time).
"""

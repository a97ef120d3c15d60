"""Metric sinks (JSONL always, TensorBoard optionally) and progress display."""

from strop.metrics.sinks import MetricsWriter

__all__ = ["MetricsWriter"]

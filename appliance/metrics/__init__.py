"""Prometheus metrics of the appliance (vLLM v1 names)."""

from appliance.metrics.registry import CONTENT_TYPE, Metrics

__all__ = ["CONTENT_TYPE", "Metrics"]

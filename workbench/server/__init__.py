"""The OpenAI-compatible HTTP server (``workbench serve``) and its Prometheus ``/metrics``."""

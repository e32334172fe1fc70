"""The OpenAI-compatible HTTP server of ``workbench serve``."""

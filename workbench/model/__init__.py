"""Llama-family model with paged attention, and weight loading through transformers."""

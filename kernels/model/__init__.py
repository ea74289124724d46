"""Llama-family model forward, weights loading and the tiny test model."""

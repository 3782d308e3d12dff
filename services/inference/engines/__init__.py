"""Inference engines: the backend interface and factory (engine.py), the torch and vLLM
backends, and the torch backend's parts (KV cache, sampling, detokenization)."""

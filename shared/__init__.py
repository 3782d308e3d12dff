"""squall's shared layer: wire schemas, key names, stream primitives, config, logging, errors.

No torch, vLLM or HTTP-server imports here: runners and the scheduler stay light.
"""

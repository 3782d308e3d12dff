"""The tool pool: rq workers that run agents' non-LLM tool calls apart from the runners."""

"""What every route of one node works with: the engine and its tokenizer, the name it serves,
the node id, the metrics, and the cache of decoded token texts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from squall.inference.engines.detokenize import decoder_of
from squall.inference.engines.engine import Engine
from squall.inference.http.protocol import ApiError
from squall.inference.http.render import TokenTexts
from squall.inference.node_metrics import InferenceMetrics
from squall.inference.prompt import ChatFormat
from squall.inference.weights.catalog import ModelUnavailable


@dataclass
class ServerState:
    """Shared by the routes of one app; built once by `server.create_app`."""

    engine: Engine  # samples tokens; holds the weight version served now
    model_name: str  # the name clients ask for (`model` in a request)
    node: str  # this node's id, in every response body
    metrics: InferenceMetrics
    reasoning: bool = True  # split <think>...</think> into reasoning_content (inference.reasoning_parser)
    tool_parser: str = "auto"  # the tool-call format (inference.tool_parser; auto: from the template)
    chat_template: str = ""  # a Jinja file replacing the model's chat template (inference.chat_template)
    token_texts: TokenTexts = field(init=False)  # token id -> its text, for logprob entries
    _chat_format: ChatFormat | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.token_texts = TokenTexts(decoder_of(self.engine.tokenizer))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def chat_format(self) -> ChatFormat:
        """How chat prompts are rendered, built on first use (the engine loads the tokenizer at start)."""
        if self._chat_format is None or self._chat_format.tokenizer is not self.tokenizer:
            self._chat_format = ChatFormat(self.tokenizer, self.tool_parser, self.chat_template)
        return self._chat_format

    async def resolve_model(self, name: str) -> tuple[str, int | None]:
        """The (role, version or None: newest) a request's `model` names, made servable by the
        engine; ApiError naming the model, the version and what exists when it cannot be."""
        try:
            role, version = self.engine.catalog.resolve(name, self.model_name)
            await self.engine.prepare(role, version)
        except ModelUnavailable as exc:
            raise model_error(exc) from None
        return role, version


def model_error(exc: ModelUnavailable) -> ApiError:
    return ApiError(exc.status, exc.message, param="model", code="model_not_found")

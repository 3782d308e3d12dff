"""An inference node: one model replica behind an OpenAI-compatible API, following weights.

Parts, each its own module, wired here and nowhere else:
- engines/ — engine.py, the backend interface and factory; torch_engine.py (transformers,
  continuous batching, kvcache.py, sampling.py, detokenize.py) and vllm_engine.py implement it;
- http/ — server.py wires the HTTP API (FastAPI) over the engine: routes.py (one plain handler
  per route, over state.py's ServerState), render.py (response bodies, SSE chunks, headers),
  gate.py (API key, request metrics); protocol.py validates request bodies, and
  ../toolcalls.py renders and parses tool calls in the format of chat_format.py;
- weights/ — reload.py follows the `weights` stream, verifies and hot-loads new versions
  (shardload.py for sharded ones, adapters.py for LoRA), acknowledges them, and writes the
  heartbeat; rides through Redis outages (shared.retry);
- node_metrics.py — the Prometheus registry behind /metrics.

Start-up order: load the model, load the newest published weights (so a restarted node never
serves a stale version), then listen. Shutdown: stop listening, stop following, stop the engine.
A follower that fails (Redis away past `run.redis_outage_s`, or anything else) stops the node,
which then exits non-zero so its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import threading

import structlog

from squall.inference.engines.engine import make_engine
from squall.inference.node_metrics import InferenceMetrics
from squall.shared.config import RunConfig
from squall.shared.errors import ConfigError, RedisUnavailable
from squall.shared.keys import Keys
from squall.shared.retry import RedisOutage

log = structlog.get_logger()


class InferenceNode:
    def __init__(self, config: RunConfig, model_dir: str | None = None) -> None:
        self.config = config
        section = config.inference
        self.model_dir = model_dir or config.model.path
        if not self.model_dir:
            raise ConfigError("no model: pass --model DIR or set model.path")
        self.node = section.node or f"{self._public_host()}:{section.port}"
        self.model_name = section.model_name or config.model.name
        self.metrics = InferenceMetrics()
        self.ready = threading.Event()  # set once the node accepts requests
        self.engine = None
        self.follower = None
        self.failure: BaseException | None = None  # why the follower stopped the node, if it did
        self._server = None

    def _public_host(self) -> str:
        """The listen address, or this machine's name when listening on every interface."""
        host = self.config.inference.host
        return socket.gethostname() if host in ("0.0.0.0", "::", "") else host

    @property
    def url(self) -> str:
        return f"http://{self._public_host()}:{self.config.inference.port}"

    async def serve(self) -> None:
        import uvicorn

        from squall.inference.http.server import create_app
        from squall.inference.weights.reload import Snapshot, WeightFollower

        section = self.config.inference
        if section.backend == "torch" and section.torch_threads:
            import torch

            torch.set_num_threads(section.torch_threads)
        # the adapters' rank is the trainer's: the one value inference takes from its section
        self.engine = engine = make_engine(section, self.model_dir, lora_rank=self.config.trainer.lora_rank)
        await engine.start()
        follow_task = None
        redis_client = None
        try:
            if section.follow_weights:
                redis_client = await self._redis()
                run = self.config.run
                outage = RedisOutage(
                    run.redis_url, run.redis_outage_s, log=log, on_outage=self.metrics.count_redis_outage
                )
                self.follower = WeightFollower(
                    redis_client,
                    Keys(run.name),
                    engine,
                    node=self.node,
                    metrics=self.metrics,
                    outage=outage,
                    metrics_port=section.port,
                    snapshot=Snapshot(section.pin_version, section.behind_versions),
                )
                await self.follower.catch_up()
                follow_task = asyncio.create_task(self.follower.run(), name="weight-follower")
                follow_task.add_done_callback(self._follower_ended)
            app = create_app(
                engine,
                model_name=self.model_name,
                node=self.node,
                api_key=section.api_key,
                metrics=self.metrics,
                reasoning_parser=section.reasoning_parser,
                tool_parser=section.tool_parser,
                chat_template=section.chat_template,
            )
            config = uvicorn.Config(
                app,
                host=section.host,
                port=section.port,
                log_level="warning",
                access_log=False,
                lifespan="off",
            )
            self._server = _quiet_server_class()(config)
            if threading.current_thread() is threading.main_thread():
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGINT, signal.SIGTERM):  # stop listening, drain, clean up
                    loop.add_signal_handler(sig, self.stop)
            serving = asyncio.create_task(self._server.serve())
            while not self._server.started and not serving.done():
                await asyncio.sleep(0.01)
            if self._server.started:
                self.ready.set()
                log.info(
                    "inference_started",
                    node=self.node,
                    url=self.url,
                    model=self.model_name,
                    backend=section.backend,
                    weight_version=engine.weight_version,
                )
            await serving
        finally:
            if self.follower is not None:
                self.follower.stop()
            if follow_task is not None:
                follow_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await follow_task
            if (
                self.follower is not None and self.failure is None and sys.exc_info()[0] is None
            ):  # a clean stop
                with contextlib.suppress(Exception):  # Redis gone: the heartbeat ages out instead
                    await self.follower.beats.stop_async(version=engine.weight_version)
            if redis_client is not None:
                await redis_client.aclose()
            await engine.stop()
            log.info("inference_stopped", node=self.node, weight_version=engine.weight_version)

    async def _redis(self):
        import redis.asyncio

        from squall.shared.redisconn import SOCKET_TIMEOUT_S, connect

        run = self.config.run
        # The sync connect pings (and may start a local Redis); the follower then reads async.
        await asyncio.to_thread(lambda: connect(run.redis_url, autostart=run.autostart_redis).close())
        return redis.asyncio.Redis.from_url(run.redis_url, socket_timeout=SOCKET_TIMEOUT_S)

    def _follower_ended(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        # A node that silently stopped following would serve stale weights forever: stop
        # instead, so the supervisor (systemd, squall up) restarts it.
        self.failure = task.exception()
        log.error(
            "weights_follower_failed",
            error=str(self.failure),
            kind=type(self.failure).__name__,
            node=self.node,
        )
        self.stop()

    def stop(self) -> None:
        """Ask a serving node to shut down (from any thread)."""
        if self._server is not None:
            self._server.should_exit = True


def _quiet_server_class():
    import uvicorn

    class QuietServer(uvicorn.Server):
        """uvicorn re-raises SIGTERM after serving, which would skip the node's clean-up;
        the node installs its own handlers instead."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return QuietServer


def run(config: RunConfig, model_dir: str | None = None) -> int:
    """Serve until stopped: 0 after a clean stop, 1 when Redis (or the follower) failed."""
    node = InferenceNode(config, model_dir)
    try:
        asyncio.run(node.serve())
    except RedisUnavailable as exc:  # no Redis at start-up
        log.error("inference_exit", error=str(exc))
        return 1
    except ConfigError as exc:  # e.g. a pinned snapshot version that cannot be served
        log.error("inference_refused", error=str(exc))
        print(f"squall inference: {exc}", file=sys.stderr)
        return 2
    return 0 if node.failure is None else 1

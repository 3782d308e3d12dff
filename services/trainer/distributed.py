"""The trainer beyond one process: the world, the process group, FSDP2 and the rank protocol.

One code path for every world size. Rank 0 runs the whole Trainer (bus, groups, ledger,
checkpoints' meta, acks, publication); every other rank runs `follow`: it builds the same
backend and executes what rank 0 tells it, one command at a time, in rank 0's order:

    train   the step's samples (all of them: each rank takes its share of the micro-batches)
    save    a checkpoint folder (each rank writes its DCP shard and its RNG)
    load    a checkpoint folder (each rank reads its shard)
    weights gather the full state dict to rank 0 (a collective: every rank takes part)
    idle    nothing: sent while rank 0 waits for data, so a follower's wait has a deadline
    stop    leave (rank 0 stopped: SIGTERM, max_steps, or an error there)

Commands travel over a gloo group (the samples are Python objects; with NCCL they would be
copied through the GPU), tensors over the default group (gloo on CPU, NCCL on CUDA). Every
collective has a timeout (`trainer.collective_timeout_s`): a rank that stops answering makes
the others raise instead of hanging; torchrun then tears the whole group down.

World size 1 needs none of this: no process group, the backend is used directly.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .backend import TrainerBackend
from .sequences import Sample

IDLE_PING_S = 2.0  # rank 0 tells the followers it is alive at least this often while waiting


class WorldSizeError(ValueError):
    """Ranks and devices (or a checkpoint) disagree about the world size."""


@dataclass(frozen=True)
class World:
    """Where this process stands among the trainer's ranks."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # rank on this node: which GPU it drives

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def current_world() -> World:
    """The world of an initialised process group (a Ray Train worker arrives with one), else
    torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK), else one process."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), local_rank)
    return World(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), local_rank)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def check_devices(device: str, ranks_per_node: int) -> None:
    """A clear error before starting when a node is asked for more CUDA ranks than it has GPUs."""
    if resolve_device(device).type != "cuda":
        return
    have = torch.cuda.device_count()
    if ranks_per_node > have:
        fix = (
            f"pass --nproc-per-node {have} or fewer (one rank per GPU)" if have else "run it on a GPU machine"
        )
        raise WorldSizeError(
            f"{ranks_per_node} ranks per node asked for with trainer.device={device!r}, but this node has "
            f"{have} CUDA device(s): {fix}, or set trainer.device = 'cpu' (ranks on CPU, over gloo)"
        )


def rank_device(device: str, world: World) -> torch.device:
    """The device this rank trains on: its own GPU (cuda:LOCAL_RANK) when on CUDA."""
    resolved = resolve_device(device)
    if resolved.type == "cuda" and world.distributed and resolved.index is None:
        return torch.device("cuda", world.local_rank)
    return resolved


def init_world(device: str, timeout_s: float) -> World:
    """Join the process group when launched with more than one rank (gloo on CPU, NCCL on
    CUDA, collectives timing out after `timeout_s`); a group already set up (Ray Train) is
    used as it is. World size 1: nothing happens."""
    world = current_world()
    if not world.distributed or dist.is_initialized():
        return world
    on_cuda = resolve_device(device).type == "cuda"
    if on_cuda:
        check_devices(device, int(os.environ.get("LOCAL_WORLD_SIZE", world.local_rank + 1)))
        torch.cuda.set_device(world.local_rank)
    dist.init_process_group(backend="nccl" if on_cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return current_world()


_CONTROL: dict[str, Any] = {}


def control_group(timeout_s: float) -> Any:
    """The gloo group commands travel on: the default group when it is gloo already. Every
    rank must call this at the same point (creating a group is a collective)."""
    if "group" not in _CONTROL:
        if dist.get_backend() == "gloo":
            _CONTROL["group"] = None  # the default group
        else:
            _CONTROL["group"] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return _CONTROL["group"]


LEAVE_BARRIER_S = 10.0  # how long a rank waits for the others to arrive before tearing down


def shutdown() -> None:
    """Leave the process group (no-op when there is none). The ranks first meet at a barrier
    (bounded: a dead rank costs LEAVE_BARRIER_S), so none tears its connections down while
    another still has the last command in flight; a teardown racing a peer's last message
    was seen to abort rank 0 once in CI."""
    group = _CONTROL.pop("group", None)
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=LEAVE_BARRIER_S))
    except RuntimeError:
        pass  # a rank is gone already: leave anyway
    dist.destroy_process_group()


# --- FSDP2 ---------------------------------------------------------------------
def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face model: the classes it lists in
    `_no_split_modules` (Qwen2DecoderLayer, LlamaDecoderLayer, ...)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class (_no_split_modules={sorted(names)}): "
            "FSDP shards per decoder layer; use a transformers causal LM that lists them"
        )
    return layers


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 over the world: each decoder layer its own unit (all-gathered for its forward and
    backward only), then the root (embeddings, final norm, head). Gradients are summed across
    ranks, not averaged: the loss weights already divide by the whole step's tokens."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict, gathered to rank 0's CPU (the other ranks get {}): the
    weights published to inference. Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def rng_file(path: Path, world: World) -> Path:
    return path / f"rng-{world.rank:05d}.pt"


def save_sharded(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rng: dict[str, Any], world: World
) -> None:
    """Model and optimizer shards (torch.distributed.checkpoint, files fsynced) and this rank's
    RNG into the folder `path`; returns once every rank's part is durable (a barrier), so
    rank 0 may then write the checkpoint's meta and ack what it lists."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    path.mkdir(parents=True, exist_ok=True)
    with open(rng_file(path, world), "wb") as handle:
        torch.save(rng, handle)
        handle.flush()
        os.fsync(handle.fileno())
    # Trainable parameters only: the frozen base of a LoRA run never changes (model.path has it).
    options = StateDictOptions(ignore_frozen_params=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    dcp.save(
        {"model": model_state, "optimizer": optimizer_state},
        storage_writer=dcp.FileSystemWriter(path, sync_files=True),
    )
    barrier()


def load_sharded(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World
) -> dict[str, Any]:
    """Read what save_sharded wrote into the sharded model and optimizer; this rank's RNG."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    if not rng_file(path, world).exists():
        raise WorldSizeError(f"{path} has no state for rank {world.rank}: it was written by fewer ranks")
    # Trainable parameters only: the frozen base of a LoRA run never changes (model.path has it).
    options = StateDictOptions(ignore_frozen_params=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    # Not strict: the frozen parameters are absent by design; every trainable one was required
    # by dcp.load above (a key missing from the checkpoint fails there).
    options = StateDictOptions(ignore_frozen_params=True, strict=False)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=options,
    )
    return torch.load(rng_file(path, world), weights_only=False)


Batch = TypeVar("Batch")  # a micro-batch plan, whatever the backend makes of it


def share_of(batches: Sequence[Batch], world: World) -> list[Batch | None]:
    """This rank's micro-batches (round robin), padded with None up to the same count on
    every rank: FSDP needs every rank to run as many forwards and backwards as the others.
    A None is run as a zero-weight micro-batch (no gradient, no metric)."""
    per_rank = -(-len(batches) // world.world_size)
    mine: list[Batch | None] = list(batches[world.rank :: world.world_size])
    return mine + [None] * (per_rank - len(mine))


def all_reduce_sums(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Every rank's `values` summed (same keys on every rank), as floats."""
    keys = sorted(values)
    tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return dict(zip(keys, tensor.tolist(), strict=True))


def broadcast_object(obj: Any, group: Any) -> Any:
    """Rank 0's `obj` on every rank (the others pass None)."""
    holder = [obj]
    dist.broadcast_object_list(holder, src=0, group=group)
    return holder[0]


def barrier(group: Any = None) -> None:
    dist.barrier(group=group)


# --- the rank protocol -------------------------------------------------------------
class Leader:
    """Rank 0's end of the protocol: every backend call the followers must join is announced."""

    def __init__(self, world: World, group: Any) -> None:
        self.world, self.group = world, group
        self.last_sent = time.monotonic()

    def send(self, command: str, *args: Any) -> None:
        broadcast_object((command, args), self.group)
        self.last_sent = time.monotonic()

    def idle(self) -> None:
        if time.monotonic() - self.last_sent >= IDLE_PING_S:
            self.send("idle")

    def stop(self, ok: bool) -> None:
        self.send("stop", ok)


class LeaderBackend(TrainerBackend):
    """The backend as rank 0's Trainer sees it: each call is first sent to the followers,
    which make the same call on their own backend."""

    def __init__(self, inner: TrainerBackend, leader: Leader) -> None:
        self.inner, self.leader = inner, leader
        self.vocab_size, self.pad_id = inner.vocab_size, inner.pad_id

    def train_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        self.leader.send("train", list(samples))
        return self.inner.train_step(samples)

    def weights(self) -> dict[str, Any]:
        self.leader.send("weights")
        return self.inner.weights()

    def save_state(self, path: Path) -> None:
        self.leader.send("save", str(path))
        self.inner.save_state(path)

    def load_state(self, path: Path) -> None:
        self.leader.send("load", str(path))
        self.inner.load_state(path)

    def adapter_config(self) -> dict[str, Any] | None:  # local: every rank holds the same config
        return self.inner.adapter_config()

    def __getattr__(self, name: str) -> Any:  # backend extras (model, device) for diagnostics
        return getattr(self.inner, name)


def follow(backend: TrainerBackend, group: Any) -> int:
    """A follower's whole life: run rank 0's commands until it says stop. Returns the exit
    code (0 when rank 0 stopped cleanly)."""
    while True:
        command, args = broadcast_object(None, group)
        if command == "stop":
            return 0 if args[0] else 1
        if command == "train":
            backend.train_step(args[0])
        elif command == "save":
            backend.save_state(Path(args[0]))
        elif command == "load":
            backend.load_state(Path(args[0]))
        elif command == "weights":
            backend.weights()
        elif command != "idle":
            raise RuntimeError(
                f"unknown command {command!r} from rank 0 (ranks run different squall versions?)"
            )

"""What handlers send to an AsyncEngine's loop thread (typed commands), and the engine's one
lifecycle state, which the loop thread alone writes (engine/serving/loop/async_engine.py)."""
from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from engine.core.processor import EngineRequest


class EngineDeadError(RuntimeError):
    pass


class RequestCancelled(RuntimeError):
    """The server ended the request (it is shutting down); the message says why."""


class Phase(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"  # a sleep was asked for: new requests refused, those in flight finish
    ASLEEP = "asleep"  # KV memory released by a sleep command: refused until a wake-up
    IDLE_ASLEEP = "idle_asleep"  # slept for being idle: the next request wakes it
    CLOSING = "closing"  # the server is shutting down: new requests refused
    STOPPED = "stopped"  # the loop has ended
    DEAD = "dead"  # a step raised: every request refused


@dataclass(frozen=True)
class Lifecycle:
    """The engine's one lifecycle state, written by the loop thread alone (replaced whole)."""
    phase: Phase = Phase.SERVING
    failure: EngineDeadError | None = None  # why it is dead


# -- the commands handlers send to the loop thread -------------------------------------------
@dataclass(frozen=True)
class Add:
    request: EngineRequest


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Sleep:
    reply: asyncio.Future
    level: int


@dataclass(frozen=True)
class Wake:
    reply: asyncio.Future
    tags: tuple[str, ...] | None = None  # "weights", "kv_cache" (vLLM's); None: both


@dataclass(frozen=True)
class Pause:
    reply: asyncio.Future
    mode: str  # "abort" | "retract" (LLMEngine.pause_generation)


@dataclass(frozen=True)
class Resume:
    reply: asyncio.Future


@dataclass(frozen=True)
class UpdateWeights:
    reply: asyncio.Future
    state: dict  # {name: tensor}, read and checked off the engine thread (LLMEngine.read_weights_from_disk)


@dataclass(frozen=True)
class Snapshot:
    reply: asyncio.Future  # gets EngineStats


@dataclass(frozen=True)
class Cancel:
    reason: str


@dataclass(frozen=True)
class Stop:
    pass


Command = Add | Abort | Sleep | Wake | Pause | Resume | UpdateWeights | Snapshot | Cancel | Stop

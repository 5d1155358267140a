"""The engine: requests, the scheduling policy, the Trio loop, metrics. No torch here: the
model step runs behind `runner.step`."""
from .engine import Engine, EngineClosed, EngineConfig
from .request import BACKGROUND, INTERACTIVE, DoneEvent, EmbeddingEvent, Request, RequestRejected, TokenEvent
from .scheduler import Scheduler, SchedulerConfig

__all__ = ["Engine", "EngineClosed", "EngineConfig", "Request", "TokenEvent", "DoneEvent", "EmbeddingEvent", "RequestRejected",
           "Scheduler", "SchedulerConfig", "INTERACTIVE", "BACKGROUND"]

"""The engine: requests, the scheduling policy, the Trio loop, metrics."""
from .engine import Engine, EngineClosed, EngineConfig
from .request import BACKGROUND, INTERACTIVE, DoneEvent, Request, TokenEvent
from .scheduler import RequestRejected, Scheduler, SchedulerConfig

__all__ = ["Engine", "EngineClosed", "EngineConfig", "Request", "TokenEvent", "DoneEvent", "RequestRejected",
           "Scheduler", "SchedulerConfig", "INTERACTIVE", "BACKGROUND"]

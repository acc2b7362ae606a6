"""Runtime API: Engine(target).generate([Request(prompt_ids, SamplingParams(...), drafter)])."""
from angelspec.runtime.engine import Engine, Event, Request, RequestState, Result, Stats
from angelspec.runtime.sampling import SamplingParams

__all__ = ["Engine", "Event", "Request", "RequestState", "Result", "SamplingParams", "Stats"]

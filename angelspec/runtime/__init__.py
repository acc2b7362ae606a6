"""Runtime API: Engine(target).generate([Request(prompt_ids, SamplingParams(...), drafter)]), or
load_engine("engines/default") for a built engine (drafts, router, D-cut profile, backend)."""
from angelspec.params import SamplingParams
from angelspec.runtime.engine import Engine, Event, Request, RequestState, Result, Stats, settle_heap
from angelspec.runtime.engine_dir import load_engine
from angelspec.runtime.manifest import EngineError, EngineManifest

__all__ = ["Engine", "EngineError", "EngineManifest", "Event", "Request", "RequestState", "Result", "SamplingParams",
           "Stats", "load_engine", "settle_heap"]

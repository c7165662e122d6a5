"""Assemble a serving engine from an EngineConfig: sink, metrics registry, engine, app."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.metrics import PrometheusStatLogger
from engine.sinks import EventSink, JsonlSink, MemorySink, NullSink


def make_sink(cfg: EngineConfig, registry: CollectorRegistry | None = None) -> EventSink:
    tcfg = cfg.telemetry
    if tcfg.sink == "none":
        return NullSink()
    if tcfg.sink == "jsonl":
        return JsonlSink(Path(tcfg.jsonl_path))
    if tcfg.sink == "http":
        from engine.http_sink import HttpSink

        return HttpSink.from_config(tcfg, registry=registry)
    return MemorySink()


def build_serving_engine(cfg: EngineConfig) -> tuple[LLMEngine, CollectorRegistry]:
    registry = CollectorRegistry()
    prom = PrometheusStatLogger(registry)
    engine = LLMEngine(cfg, sink=make_sink(cfg, registry), stat_loggers=[prom])
    prom.set_page_bytes(engine.kv.page_bytes)
    return engine, registry


def build_app(cfg: EngineConfig, *, warmup: bool = True) -> FastAPI:
    from engine.server import create_app

    engine, registry = build_serving_engine(cfg)
    if warmup:
        engine.warmup()
    return create_app(engine, registry)

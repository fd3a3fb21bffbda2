"""Which asyncio event loop every process of ours runs: uvloop (libuv's loop, a dependency) unless
``CHATPLANE_EVENT_LOOP=asyncio`` asks for the standard library's, so that the two can be measured
against each other on the same build (docs/cost.md).

Every ``main`` calls ``use_event_loop()`` before it creates its first loop (``asyncio.run``, faust's
worker); the edge hands the kind to uvicorn (``uvicorn.Config(loop=...)``), which installs it itself.
"""

from __future__ import annotations

import asyncio

import uvloop

from infra.runtime.settings import env_value

EVENT_LOOP_ENV = "CHATPLANE_EVENT_LOOP"
EVENT_LOOPS = ("uvloop", "asyncio")
EVENT_LOOP_DEFAULT = "uvloop"


def event_loop_kind() -> str:
    """``uvloop`` or ``asyncio`` (``CHATPLANE_EVENT_LOOP``); a ``SettingsError`` names a bad value."""
    return env_value(EVENT_LOOP_ENV, EVENT_LOOP_DEFAULT, kind=str, choices=EVENT_LOOPS)


def use_event_loop() -> str:
    """Make every loop this process creates from now on the configured kind; returns the kind."""
    kind = event_loop_kind()
    if kind == "uvloop":
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return kind

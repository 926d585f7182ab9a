"""Runs the core's defragmentation policy inside the service.

The core decides *what* to move (`defrag_due`, `plan_defrag`); this runner decides *when*
to ask and drives a plan's life cycle:

- every `check_every_steps` scheduler steps (the policy check scans a pool's tables, so not
  per step) and on admin request, it journals a `plan_defrag` for each pool the policy flags;
  the plan's moves go into the pool's open step and reach the node inside the scheduler's
  next Forward (only blocks whose writing step is settled move);
- the plan commits when the scheduler reports that step's Forward complete (inside the
  journaled `step` op that carries the report, see `ServiceState`), and aborts if it failed;
- a plan not committed within `timeout_s` is aborted (journaled `abort_defrag`), so a
  scheduler that went away never leaves reserved blocks behind.

Every decision goes through `ServiceRuntime.mutate`, i.e. it is journaled and replayed
like a client request; timers are per plan (no polling).
"""

from __future__ import annotations

import asyncio
from typing import Any

from block_manager.core.errors import CoreError
from block_manager.service.config import DefragSettings
from block_manager.service.runtime import ServiceRuntime, internal_request_id
from block_manager.service.sessions import SessionRef
from block_manager.store.records import Body
from pagedkv.lifecycle import TaskSet
from pagedkv.logging import get_logger

log = get_logger(__name__)

_PLAN_OPS = ("plan_defrag",)
_END_OPS = ("step", "abort_defrag", "expire_node", "register_node", "release_pool")


class DefragRunner:
    def __init__(self, runtime: ServiceRuntime, settings: DefragSettings, tasks: TaskSet | None = None) -> None:
        self.runtime = runtime
        self.tasks = tasks or TaskSet("defrag")
        self.settings = settings
        self.check_every_steps = settings.check_every_steps
        self._steps_since_check = 0
        self._checking = False
        self._timeouts: dict[int, asyncio.TimerHandle] = {}
        self.num_plans_started = 0
        self.num_plans_timed_out = 0
        runtime.on_applied(self._after_apply)

    # ---- hooks ----------------------------------------------------------------------
    def _after_apply(self, op: str, result: Body) -> None:
        if isinstance(result, dict):   # not a Step's packed answer (steps are only counted below)
            self._track_plans(op, result)
        elif op in _END_OPS:
            self._disarm_finished()
        if op == "step" and self.settings.enabled:
            self._steps_since_check += 1
            if self._steps_since_check >= self.check_every_steps and not self._checking:
                self._steps_since_check = 0
                self._checking = True
                self.tasks.spawn(self._policy_check(), name="defrag-policy-check")

    def _track_plans(self, op: str, result: dict[str, Any]) -> None:
        if op in _PLAN_OPS and result.get("plan"):
            self._arm(result["plan"]["plan_id"])
        elif op == "trigger_defrag":
            for plan in result["plans"]:
                self._arm(plan["plan_id"])
        elif op in _END_OPS:
            self._disarm_finished()

    def arm_outstanding(self) -> None:
        """Give plans that survived a restart a fresh timeout."""
        for plan in self.runtime.state.outstanding_plans():
            self._arm(plan.plan_id)

    def close(self) -> None:
        for handle in self._timeouts.values():
            handle.cancel()
        self._timeouts.clear()

    # ---- timeouts -------------------------------------------------------------------
    def _arm(self, plan_id: int) -> None:
        if plan_id in self._timeouts:
            return
        self.num_plans_started += 1
        loop = asyncio.get_running_loop()
        self._timeouts[plan_id] = loop.call_later(
            self.settings.timeout_s, lambda: self.tasks.spawn(self._timeout(plan_id), name=f"defrag-timeout-{plan_id}")
        )

    def _disarm_finished(self) -> None:
        live = {p.plan_id for p in self.runtime.state.outstanding_plans()}
        for plan_id in [pid for pid in self._timeouts if pid not in live]:
            self._timeouts.pop(plan_id).cancel()

    async def _timeout(self, plan_id: int) -> None:
        self._timeouts.pop(plan_id, None)
        if plan_id not in {p.plan_id for p in self.runtime.state.outstanding_plans()}:
            return
        rid = internal_request_id("defrag-timeout", plan_id)
        try:
            await self.runtime.mutate("abort_defrag", rid, rid, {"plan_id": plan_id}, internal=True)
        except Exception as exc:  # noqa: BLE001 - logged; nothing else to do
            log.error("defrag abort failed", plan_id=plan_id, error=repr(exc))
            return
        self.num_plans_timed_out += 1
        log.warning("defrag plan timed out and was aborted", plan_id=plan_id)

    # ---- planning -------------------------------------------------------------------
    async def _policy_check(self) -> None:
        try:
            state = self.runtime.state
            for pool_id in list(state.core.pool_ids):
                if self.runtime.phase != "serving":
                    return
                try:
                    kind = state.core.defrag_due(pool_id)
                except CoreError:
                    continue
                if kind is None:
                    continue
                seq = self.runtime.writer.last_seq_no
                rid = internal_request_id("defrag-policy", pool_id, seq, self.num_plans_started)
                await self.plan(pool_id, kind, rid, rid)
        except Exception as exc:  # noqa: BLE001 - a failed policy run must not kill the server
            log.error("defrag policy check failed", error=repr(exc))
        finally:
            self._checking = False

    async def plan(self, pool_id: str, kind: str, request_id: str, digest: str) -> dict[str, Any] | None:
        """Journal a plan for one pool (None: nothing to move)."""
        payload = {"pool_id": pool_id, "kind": kind, "max_moves": self.settings.max_moves}
        result = await self.runtime.mutate("plan_defrag", request_id, digest, payload, internal=True)
        plan = result.get("plan")
        if plan:
            log.info("defrag plan", pool=pool_id, kind=kind, plan_id=plan["plan_id"], moves=len(plan["moves"]))
        return plan

    async def trigger(
        self, pool_id: str | None, kind: str, request_id: str, digest: str, session: SessionRef | None = None,
    ) -> list[dict[str, Any]]:
        """Admin trigger: plan `kind` for one pool or every pool without a plan, as one
        journaled op (`trigger_defrag`) recorded under the admin's request id (or session
        number), so a resend gets the identical answer."""
        payload = {"pool_id": pool_id or "", "kind": kind, "max_moves": self.settings.max_moves}
        result = await self.runtime.mutate("trigger_defrag", request_id, digest, payload, session=session)
        plans: list[dict[str, Any]] = result["plans"]
        for plan in plans:
            log.info("defrag plan", pool=plan["pool_id"], kind=kind, plan_id=plan["plan_id"], moves=len(plan["moves"]))
        return plans


__all__ = ["DefragRunner"]

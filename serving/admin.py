"""Admin endpoints: the draft in use, loading a draft, speculation and capture settings.

All of them need `Authorization: Bearer <token>` with the token the server was started with; a
server started without one has its admin API switched off.
"""

from __future__ import annotations

import secrets
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, Field

from tide.models.eagle3 import DraftLoadError, DraftMismatchError
from tide.serving.capture import CapturePolicy, CaptureRule, check_workload
from tide.serving.engine import Engine


class LoadDraft(BaseModel):
    path: str
    workload: str = "default"


class Speculation(BaseModel):
    gamma: int | None = Field(default=None, ge=0)  # a fixed gamma
    adaptive: bool = False  # or the controller's choice at every step


class CaptureSetting(BaseModel):
    workload: str  # "*": the rule for workloads without one of their own
    enabled: bool = True
    fraction: float = Field(default=1.0, ge=0.0, le=1.0)
    auto: bool = False  # the controller decides while the workload needs training


def admin_router(engine: Engine, capture: CapturePolicy, token: str | None) -> APIRouter:
    draft_path: dict[str, str] = {}  # drafts loaded through this API, by workload

    def authorised(request: Request) -> None:
        if token is None:
            raise HTTPException(403, "the admin API is off: start the server with --admin-token")
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(value.encode(), token.encode()):
            raise HTTPException(401, "admin endpoints need 'Authorization: Bearer <admin token>'")

    router = APIRouter(prefix="/admin", dependencies=[Depends(authorised)])

    def drafts() -> dict[str, Any]:
        return {w: {"version": v, "path": draft_path.get(w)} for w, v in engine.draft_versions().items()}

    @router.get("/state")
    def state() -> dict[str, Any]:
        return {
            "drafts": drafts(),
            "speculation": {
                "gamma": engine.gamma,
                "adaptive": engine.adaptive,
                "max_gamma": engine.cfg.max_gamma,
            },
            "capture": capture.snapshot(),
            "accept_rate_by_depth": engine.stats.rates(),
            "queue_depth": len(engine.waiting),
            "running": len(engine.running),
        }

    @router.get("/drafts")
    def get_drafts() -> dict[str, Any]:
        return drafts()

    @router.post("/drafts")
    def load_draft(body: LoadDraft) -> dict[str, Any]:
        # sync handler: FastAPI runs it in a worker thread, so loading never stalls other requests
        try:
            workload = check_workload(body.workload)
            draft = engine.load_draft(body.path, workload)
        except (DraftLoadError, DraftMismatchError, OSError) as e:
            raise HTTPException(400, f"draft refused, the current one stays: {e}") from None
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        draft_path[workload] = body.path
        return {"workload": workload, "version": draft.cfg.version, "status": "swapping at the next step"}

    @router.put("/speculation")
    def set_speculation(body: Speculation) -> dict[str, Any]:
        try:
            if body.adaptive:
                engine.set_adaptive()
            elif body.gamma is not None:
                engine.set_gamma(body.gamma)
            else:
                raise ValueError("give a fixed 'gamma' or 'adaptive': true")
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        return {"gamma": engine.gamma, "adaptive": engine.adaptive}

    @router.get("/controller")
    def controller() -> dict[str, Any]:
        c = engine.controller
        if c is None:
            return {"adaptive": False, "gamma": engine.gamma}
        return {
            "adaptive": engine.adaptive,
            "gamma": engine.gamma,
            "predicted_speedup": c.last.predicted_speedup,
            "measured_speedup": c.measured_speedup,
            "workloads": {w: {**snap, "capture": capture.active(w)} for w, snap in c.snapshot().items()},
        }

    @router.get("/capture")
    def get_capture() -> dict[str, Any]:
        return capture.snapshot()

    @router.put("/capture")
    def set_capture(body: CaptureSetting) -> dict[str, Any]:
        try:
            rule = CaptureRule(body.enabled, body.fraction, body.auto)
            if body.workload == "*":
                capture.fallback = rule
            else:
                capture.set(check_workload(body.workload), rule)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        return {"workload": body.workload, **asdict(rule)}

    return router

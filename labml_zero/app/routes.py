"""
---
title: Two of labml-app's routes, changed
summary: The app's track and runs-list routes, each labml-app's handler with one
  change: a run's last records are answered at once, and a damaged record leaves
  only its own run out of the list.
---

# Two of labml-app's routes, changed

The [server](server.html) registers these before labml-app's own routes, so
that they answer the same paths.
"""

# No postponed annotations here: FastAPI reads each handler's `Request`
# annotation when the route is registered, and the handlers import it locally.
import sys

from labml_zero.app.records import RecordError

__all__ = ["track_endpoint", "runs_endpoint", "TRACK_PAUSE_S"]

# Each is
# labml-app's handler (of the labml-app release `pyproject.toml` accepts) with
# the one change its note names.

# labml-app's pause before it answers a `track` request.
TRACK_PAUSE_S = 3.0
# What a record that does not load (`RecordError`), or loads with a field of the
# wrong shape, raises in labml-app's code: it leaves that run out of the list.
DAMAGED = (RecordError, TypeError, ValueError, KeyError, AttributeError)


def run_ends(body) -> bool:
    """Whether a `track` body carries a run's status: labml sends one, when the
    run ends."""
    items = body if isinstance(body, list) else [body]
    return any(isinstance(item, dict) and "status" in item for item in items)


def track_endpoint():
    """
    ### `POST /api/v1/{token}/track`, a run's last request answered at once

    #### Note: a run's last request is not paused

    labml-app stores what a `track` request carries, then waits `TRACK_PAUSE_S`
    before it answers, so that the run's next request carries what came
    meanwhile. The request with the run's status, sent once when the run ends,
    has nothing after it to gather: it is answered at once. A rank that waits
    for that answer before it exits ([tracking](../finetune/tracking.html))
    then has it within the launcher's grace period, even when the request
    before it was still paused. `_update_run`, the body of labml-app's own
    handler, is the one private name of labml-app this page uses.
    """
    import asyncio

    from fastapi import Request
    from labml_app import handlers

    async def track(request: Request):
        query = request.query_params
        answer = await handlers._update_run(
            request, query.get("labml_token", ""), query.get("labml_version", ""),
            query.get("run_uuid", ""), int(query.get("rank", 0)),
            int(query.get("world_size", 0)), int(query.get("main_rank", 0)))
        if not run_ends(await request.json()):
            await asyncio.sleep(TRACK_PAUSE_S)
        return answer

    return track


def folder_runs(listed, folder_name: str) -> list[str]:
    """The run uuids labml-app's list takes from the project `listed`: its
    folder's, or every run of the project for `all`."""
    uuids = list(listed.runs) if folder_name == "all" else []
    if folder_name in listed.folders:
        folder = listed.folders[folder_name].load()
        if folder:
            uuids = list(folder.run_uuids)
    return uuids


def runs_endpoint():
    """
    ### `GET /api/v1/runs/{token}`, one run at a time

    #### Note: a damaged record costs only its run

    labml-app loads every run of the list in one pass, and skips a run only for
    a `TypeError`: one record that did not load (a truncated file, any
    `RecordError`), or loaded with a field of the wrong shape, failed the whole
    request, and the page listed no run at all. This is labml-app's `get_runs`
    (the same login and token check, folder, fields and order) taking the runs
    one at a time: a run whose records raise one of `DAMAGED` is left out, with
    one log line naming it and why (the file, for a `RecordError`), and the
    others are listed. The damaged run's own page asks for the record again and
    gets the guard's `500` naming the file (see Note: every request passes one
    guard). Unlike labml-app's, the list only reads: it leaves the project's
    entries of deleted runs, which it skips, to labml-app's other routes.
    """
    from typing import Optional

    from fastapi import Request
    from labml_app import auth
    from labml_app.db import folder, project, run, user

    @auth.login_required
    @auth.check_labml_token_permission
    async def get_runs(request: Request, labml_token: str,
                       token: Optional[str] = None,
                       folder_name: str = folder.DefaultFolders.DEFAULT.value):
        if labml_token:
            listed = project.get_project(labml_token)
        else:
            listed = user.get_by_session_token(token).default_project
        runs = []
        for run_uuid in folder_runs(listed, folder_name):
            try:
                found = run.get(run_uuid)
                if found is None:  # deleted
                    continue
                entry = {**found.get_summary(), **found.status.load().get_data()}
                # the list is in start order: a run with no start time has no
                # place in it
                if not isinstance(entry["start_time"], (int, float)):
                    raise TypeError(f"start_time is {entry['start_time']!r}")
                runs.append(entry)
            except DAMAGED as e:
                message = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                print(f"labml app: the runs list leaves out run {run_uuid}: "
                      f"{message}", file=sys.stderr, flush=True)
        runs.sort(key=lambda entry: entry["start_time"], reverse=True)
        return {"runs": runs, "labml_token": listed.labml_token}

    return get_runs

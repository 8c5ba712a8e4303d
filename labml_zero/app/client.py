"""
---
title: Sending a run to the labml app, only when it is there
summary: Check that a labml app answers before labml's web-API writer is switched on,
  so a run without the app never hangs; the settings labml needs for the app; the
  run page's health charts and configuration.
---

# Sending a run to the labml app, only when it is there

labml's client sends a run's configs, status and tracked series to the
[labml app](server.html) over HTTP, at one setting, `app_url` (see `check_app_url`).
With a URL where nothing answers, a run would train to the end and then never exit
(see `app_url_if_running`). So a run asks first, and switches the `app` writer on
only when a labml app answered:

```python
from labml import experiment, lab
from labml_zero.app.client import app_url_if_running, labml_app_settings

url = app_url_if_running("http://127.0.0.1:5005/api/v1/default/")
writers = {"screen"}
if url is not None:
    lab.configure(labml_app_settings(url))
    writers.add("app")
experiment.create(name="run", writers=writers)
```

Once the run is in the app, `show_run_health` puts its health charts and its
configuration in view.
"""

# The standard library only, so the core install (without the `app` extra) can
# call this file.
import json
import threading
import urllib.error
import urllib.parse
import urllib.request

__all__ = ["DEFAULT_APP_URL", "check_app_url", "app_url_if_running",
           "labml_app_settings", "web_api_root", "run_series_names",
           "show_run_health"]

DEFAULT_APP_URL = "http://127.0.0.1:5005/api/v1/default/"
"""Where `python -m labml_zero.app` listens with its default port and token."""


def check_app_url(url: str) -> str:
    """
    ### Check the shape of an app URL

    labml learns where to send from `app_url` (`.labml.yaml`'s `app_url:`,
    `labml.lab.configure({'app_url': ...})` or the environment variable
    `labml_app_url`), and turns it into
    `{app_url}track?run_uuid=...&labml_version=...`. So `app_url` is a base URL
    that ends in a path segment and has no `?`; for our app it is
    `DEFAULT_APP_URL`, where `default` is the project token the app files runs
    under.

    Returns it with a trailing `/`, the form labml appends `track?` to. A wrong URL
    is a `ValueError` naming what is wrong, before any request is made.
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"app url must be a non-empty string, got {url!r}")
    url = url.strip()
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"app url must start with http:// or https:// and name a "
                         f"host, got {url!r}")
    # labml appends `track?...` itself and refuses a `?` in the base.
    if parts.query or parts.fragment or "?" in url:
        raise ValueError(f"app url must have no '?' or '#' part, got {url!r}")
    if not parts.path.strip("/"):
        raise ValueError(f"app url must end in the project path, e.g. "
                         f"{DEFAULT_APP_URL!r}, got {url!r}")
    return url if url.endswith("/") else url + "/"


def app_url_if_running(url: str, *, timeout_s: float = 2.0) -> str | None:
    """
    ### The URL if a labml app answers there, else `None`

    * `url` is the app's API base, as in `DEFAULT_APP_URL`.
    * `timeout_s` bounds the one request, all of it; the run waits at most this
      long.

    labml's sender is a non-daemon thread that retries a failed request forever;
    before retry $r$ it sleeps $10 r$ seconds
    (tested: tests/test_app.py::test_labmls_sender_retries_forever_10r_seconds_apart).
    So with a URL where nothing answers, a run would train to the end and then
    never exit; this one cheap request with a short timeout comes first.

    The request is `GET {api}/run/status/<a uuid no run has>`, one level above the
    project token. A labml app answers it with status 404
    (tested: tests/test_app.py::test_the_app_answers_the_probe_with_404_and_json)
    and the JSON body `{}`, and creates nothing, unlike a `POST .../track`, which
    would make a run and which the app answers only after a 3 s pause. Anything
    else (refused, timed out, HTML, a server error) means no app. Any labml app
    answers the same way, ours or one with MongoDB; a different server that
    happens to return JSON there would pass.

    The probe happens once, before the run. An app that stops answering in the
    middle of a run is handled by the fine-tune's own sender, whose every wait
    is bounded ([tracking](../finetune/tracking.html)); a plain labml run like
    the one above still has labml's, which retries when the run ends.
    """
    url = check_app_url(url)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    probe = web_api_root(url) + "run/status/labmlzeroprobe"
    # `urlopen`'s timeout bounds each read, not the request: a server that
    # sends a byte a second would hold the run (and every rank waiting for
    # this one) for as long as it likes. So the request runs on a daemon
    # thread, given `timeout_s` in all; one that has not answered by then is
    # no app, and is left to end on its own.
    answered: list[bool] = []
    thread = threading.Thread(target=lambda: answered.append(
        answers_as_an_app(probe, timeout_s)), daemon=True, name="labml app probe")
    thread.start()
    thread.join(timeout_s)
    return url if answered and answered[0] else None


def answers_as_an_app(probe: str, timeout_s: float) -> bool:
    """Whether `probe` answers as a labml app does: found, or not found (an
    unknown run), with a JSON body."""
    try:
        with urllib.request.urlopen(probe, timeout=timeout_s) as response:
            status, headers, body = response.status, response.headers, response.read()
    except urllib.error.HTTPError as e:
        # An unknown run is the app's 404
        # (tested: tests/test_app.py::test_the_app_answers_the_probe_with_404_and_json):
        # read its body like a success's.
        status, headers, body = e.code, e.headers, e.read()
    except (urllib.error.URLError, OSError):
        return False
    if status not in (200, 404):
        return False
    if "json" not in (headers.get("content-type") or ""):
        return False
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


def labml_app_settings(url: str) -> dict:
    """
    ### Settings for `labml.lab.configure`

    `app_url` is what the `app` writer sends to. `app_open_browser` is off: labml
    would open a browser tab on the run's page from the main rank when the app
    first answers, which on a headless or remote machine does nothing useful.

    A distributed run is one run in the app when every rank calls
    `experiment.create` with the same `uuid` and its own `distributed_rank` and
    `distributed_world_size`: the app files rank $r > 0$ as `{uuid}_{r}` and
    merges the ranks' series on the page of `{uuid}`.
    """
    return {"app_url": check_app_url(url), "app_open_browser": False}


def web_api_root(url: str) -> str:
    """
    #### The page's API, one level above the project token

    Runs send to the project's `track`, under the token; the page reads and
    edits a run one level up, at `run/<uuid>`, `metrics/<uuid>` and so on.
    """
    url = check_app_url(url)
    return url[:url.rstrip("/").rfind("/") + 1]


def call_json(url: str, body=None, *, timeout_s: float):
    """One request to the page's API; a JSON body makes it a `POST`."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def chart_preferences(selected: tuple[str, ...], names: list[str]) -> dict:
    """
    #### A chart's preferences: which of the run's series it draws

    labml-app keeps a chart's choice as one entry per series, in the order its
    API lists them: $1$ drawn, $-1$ only a spark line. The other fields are
    labml-app's defaults (linear scale, half smoothing).
    """
    return {"series_preferences": [1 if n in selected else -1 for n in names],
            "chart_type": 0, "step_range": [-1, -1], "focus_smoothed": True,
            "smooth_value": 0.5, "smooth_function": "exponential"}


def run_series_names(url: str, run_uuid: str, *,
                     timeout_s: float = 5.0) -> list[str] | None:
    """
    #### The run's series, in the order the page lists them

    `None` while the app answers that it has no such run (the run's first
    records are still on their way).
    """
    try:
        series = call_json(f"{web_api_root(url)}metrics/{run_uuid}",
                           {"get_all": False}, timeout_s=timeout_s)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise
    return [s["name"] for s in series.get("series") or []]


def show_run_health(url: str, run_uuid: str, charts: dict[str, tuple[str, ...]],
                    *, ready: tuple[str, ...], timeout_s: float = 5.0) -> bool:
    """
    ### Put a run's charts and configuration on its page

    * `charts` maps a chart's title to the series it draws; a chart none of
      whose series the run has is left out.
    * `ready` names the series that must have arrived first: the list of
      series fixes the meaning of each chart's preferences.

    labml-app's run page draws one chart, of the series whose first name is
    `loss`, and lists a run's configuration only where the run has *selected*
    configs (the page's own "select" button). A *custom metric* is a further
    chart on the page with its own choice of series. This makes one for each
    of `charts` and selects every config, with the page's own requests. Called
    again, it changes only a chart whose choice no longer has one entry a
    series (a series arrived since): a chart edited on the page keeps its
    edits until then.

    Returns `False`, having changed nothing, while the run, its `ready`
    series or its configs have not arrived; an app that fails raises `OSError`
    or `ValueError`.
    """
    api = web_api_root(url)
    names = run_series_names(url, run_uuid, timeout_s=timeout_s)
    try:
        run = call_json(f"{api}run/{run_uuid}", timeout_s=timeout_s)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return False
        raise
    if names is None:
        return False
    keys = [c["key"] for c in run.get("configs") or []]
    if not set(ready) <= set(names) or not keys:
        return False
    made = {m["name"]: m for m in call_json(f"{api}custom_metrics/{run_uuid}",
                                            timeout_s=timeout_s)["metrics"]}
    for title, selected in charts.items():
        if not set(selected) & set(names):
            continue
        chart = made.get(title)
        # A series that arrives later shifts the entries after it: a chart
        # whose list no longer has one entry a series is chosen again.
        if chart is not None and \
                len(chart["preferences"]["series_preferences"]) == len(names):
            continue
        if chart is None:
            chart = call_json(f"{api}custom_metrics/{run_uuid}/create",
                              {"name": title, "description": ", ".join(selected)},
                              timeout_s=timeout_s)
        call_json(f"{api}custom_metrics/{run_uuid}",
                  {"id": chart["id"], "name": title,
                   "description": chart["description"],
                   "preferences": chart_preferences(selected, names)},
                  timeout_s=timeout_s)
    if sorted(run.get("selected_configs") or []) != sorted(keys):
        call_json(f"{api}run/{run_uuid}", {"selected_configs": keys},
                  timeout_s=timeout_s)
    return True

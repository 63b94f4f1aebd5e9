"""``clusterflow ui`` against a running cluster, seen by a real headless Chromium.

One cluster (two workers that lease splits from the manager's data service and report
their figures), one dashboard and one browser serve the whole module; finalizers stop
all three even when a test fails. Debian's ``chromium`` is driven by Playwright through
``executable_path`` (``.ci/run`` installs it when missing). The tests run in file order:
the last one stops the cluster with the page's stop button.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clusterflow.manager.stopper import cluster_processes, kill_processes
from conftest import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

CLI = (sys.executable, "-m", "clusterflow.cli.main")
TOKEN = "dashboard-test-token-0123456789"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

JOB = textwrap.dedent(
    """
    import math, sys, time
    from clusterflow.data import distributed_dataset
    from clusterflow.train import report

    data = distributed_dataset(sys.argv[1], batch_size=10, split_size=20, seed=1, epochs=None)
    for step, batch in enumerate(data, start=1):
        report(step=step, loss=2.0 / math.sqrt(step), samples_per_s=10.0 / 0.2)
        if step % 5 == 0:
            print(f"step {step}", flush=True)
        time.sleep(0.2)
    """
)


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLUSTERFLOW_")}
    env.pop("TF_CONFIG", None)
    return {**env, "CLUSTERFLOW_HOME": str(home), **extra}


@dataclass
class Site:
    """A running dashboard: its base URL and the cluster it watches."""

    base: str
    cluster_id: str
    home: Path
    data: str
    """The Parquet file the cluster's workers read (400 records)."""

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, str, Any]:
        request = urllib.request.Request(self.base + path, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status, reply.read().decode(), reply.headers
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(), exc.headers

    def post(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
        request = urllib.request.Request(
            self.base + path, data=b"", method="POST", headers=headers or {}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def state(self) -> dict[str, Any]:
        path = self.home / "clusters" / self.cluster_id / "state.json"
        data: dict[str, Any] = json.loads(path.read_text())
        return data


def _start_ui(home: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    """``clusterflow ui ARGS --port 0``; returns it and the URL it printed."""
    proc = subprocess.Popen(
        [*CLI, "ui", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(home, CLUSTERFLOW_UI_TOKEN=TOKEN),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # printed once the port is bound
    if not line.startswith("dashboard: "):
        proc.kill()
        raise AssertionError(f"clusterflow ui printed {line!r}; stderr: {proc.stderr.read()}")
    return proc, line.split()[1]


def _end(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    root = tmp_path_factory.mktemp("dashboard")
    home = root / "home"
    table = pa.table({"x": pa.array([0.5] * 400)})
    data = str(root / "data.parquet")
    pq.write_table(table, data)
    (root / "job.py").write_text(JOB)
    started = subprocess.run(
        [*CLI, "start", "--detach", "--workers", "2", "--", sys.executable, "job.py", data],
        capture_output=True,
        text=True,
        cwd=root,
        env=_env(home),
        timeout=90,
        check=False,
    )
    cluster_id = started.stdout.strip()
    ui: subprocess.Popen[str] | None = None
    try:
        assert started.returncode == 0 and cluster_id, started.stderr
        ui, url = _start_ui(home)
        yield Site(url.split("/?")[0], cluster_id, home, data)
    finally:
        if ui is not None:
            _end(ui)
        if cluster_id:
            subprocess.run(
                [*CLI, "stop", cluster_id, "--grace", "5"],
                capture_output=True,
                env=_env(home),
                timeout=60,
                check=False,
            )
            kill_processes(cluster_processes(cluster_id), 5.0)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    assert os.path.exists(CHROMIUM), "Debian's chromium is missing: apt-get install -y chromium"
    with sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        chrome = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield chrome
        finally:
            chrome.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1300, "height": 1000})
    try:
        yield context.new_page()
    finally:
        context.close()


def _figure(site: Site, task: str, key: str) -> Any:
    found = [t for t in site.state()["tasks"] if t["task"] == task]
    return found[0].get(key) if found else None


def test_the_page_holds_the_tasks_and_its_chart_moves_as_training_advances(
    site: Site, page: Any, tmp_path: Path
) -> None:
    wait_until(
        lambda: _figure(site, "worker:0", "step") and _figure(site, "worker:1", "step"),
        60,
        "both workers to report a step",
    )
    page.goto(f"{site.base}/clusters/{site.cluster_id}")
    page.wait_for_selector("#tasks tbody tr[data-task]")
    tasks = page.eval_on_selector_all(
        "#tasks tbody tr[data-task]", "rs => rs.map(r => r.dataset.task)"
    )
    assert tasks == ["worker:0", "worker:1"]
    assert page.text_content("#status") == "running"

    # The chart fills from the page's own stream, which may not have delivered yet.
    page.wait_for_function("cf.lastPoint('step', 'worker:0') > 0", timeout=30_000)
    first = page.evaluate("cf.lastPoint('step', 'worker:0')")
    assert isinstance(first, int) and first > 0
    page.wait_for_function(f"cf.lastPoint('step', 'worker:0') > {first}", timeout=30_000)
    # The point's value is the step the manager recorded, not something the page made up.
    shown = page.evaluate("cf.lastPoint('step', 'worker:0')")
    assert first < shown <= _figure(site, "worker:0", "step")

    # The data service's progress and each task's log tail, following.
    page.wait_for_function(
        "document.querySelectorAll('#data tbody tr td').length >= 6", timeout=20_000
    )
    row = page.eval_on_selector_all("#data tbody tr td", "cs => cs.map(c => c.textContent)")
    assert row[0] == "default"  # distributed_dataset's name when given none
    assert int(row[2]) == 20  # 400 records in splits of 20
    page.wait_for_function(
        "document.querySelector('#logs pre[data-task=\"worker:1\"]').textContent.includes('step')",
        timeout=20_000,
    )
    shot = tmp_path / "cluster.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


MISALIGNED = """() => [...document.querySelectorAll("table.grid")].flatMap((table) => {
  const heads = [...table.querySelectorAll("thead th")];
  return [...table.querySelectorAll("tbody tr")]
    .filter((tr) => tr.children.length === heads.length)
    .flatMap((tr) => [...tr.children].map((td, i) => {
      const [cell, head] = [getComputedStyle(td).textAlign, getComputedStyle(heads[i]).textAlign];
      return cell === head ? null : `${table.id}/${heads[i].textContent}: ${cell} under ${head}`;
    }).filter(Boolean));
})"""
"""Every cell whose alignment differs from its column header's, as ``table/header``."""

TICKS = """async () => {
  const box = document.createElement("div");
  document.body.appendChild(box);
  const xs = [...Array(20).keys()];
  const plot = new uPlot({ width: 400, height: 200, series: [{}, { stroke: "red" }],
    scales: { x: { time: false } }, axes: [{}, cf.yAxis("loss")] },
    [xs, xs.map((i) => 2.329 + i * 0.00001)], box);
  while (!plot.axes[1]._values) await new Promise((r) => requestAnimationFrame(r));
  const labels = plot.axes[1]._values;
  plot.destroy();
  box.remove();
  return labels;
}"""
"""The loss axis's tick labels for a loss between 2.32900 and 2.32919 (uPlot's own
default showed ``2.329`` on every tick)."""


def test_counts_and_numbers_mean_what_their_headers_say(site: Site, page: Any) -> None:
    """Pins the ``num`` class on number headers (dashboard.css: a number column's
    header is right-aligned as its cells are), the data row's counts
    (``data_progress._row``: acknowledged + leased + pending = the epoch's splits), the
    loss axis's ``tickLabels`` (no label twice), and the checkpoint folder left unnamed
    while it holds no committed checkpoint (this job saves none)."""
    wait_until(
        lambda: _figure(site, "worker:0", "step") and _figure(site, "worker:1", "step"),
        60,
        "both workers to report a step",
    )
    page.goto(f"{site.base}/clusters/{site.cluster_id}")
    page.wait_for_function(
        "document.querySelectorAll('#data tbody tr td').length >= 7", timeout=20_000
    )
    page.wait_for_selector("#tasks tbody tr[data-task]")
    assert page.evaluate(MISALIGNED) == []
    heads = page.eval_on_selector_all("#data thead th", "hs => hs.map(h => h.textContent)")
    cells = page.eval_on_selector_all("#data tbody tr td", "cs => cs.map(c => c.textContent)")
    row = dict(zip(heads, cells, strict=True))
    assert int(row["acknowledged"]) + int(row["leased"]) + int(row["pending"]) == int(
        row["splits"]
    ), row
    labels = page.evaluate(TICKS)
    assert len(labels) >= 3 and len(set(labels)) == len(labels), labels
    assert page.text_content("#checkpoint-dir") == "- (no checkpoint committed yet)"

    page.goto(site.base + "/")
    page.wait_for_selector(f"#clusters a[href='/clusters/{site.cluster_id}']")
    assert page.evaluate(MISALIGNED) == []


MEMBERSHIP_ROWS = """(view) => {
  cf.renderMembership(view);  // read back at once: the stream re-renders the real one
  const rows = [...document.querySelectorAll("#membership tbody tr")];
  return [document.getElementById("workers-size").textContent,
    rows.map((tr) => [...tr.children].map((td) => td.textContent))];
}"""
"""Renders a membership view into the page and returns what it shows."""


def test_the_membership_shows_the_size_the_range_and_who_joined_and_left(
    site: Site, page: Any
) -> None:
    """Pins ``views.membership`` on the cluster's page (``renderMembership``): this
    cluster's fixed size, as the manager's state has it, then the rows of an elastic
    cluster's history (the view of a state, as ``test_membership_view`` builds it)."""
    from clusterflow.manager.state import ClusterState, MembershipChange
    from clusterflow.ui import views

    page.goto(f"{site.base}/clusters/{site.cluster_id}")
    page.wait_for_function(
        "document.getElementById('workers-size').textContent === '2 workers, fixed size'",
        timeout=20_000,
    )
    assert page.text_content("#membership tbody") == "a fixed size: scale does not resize it"
    history = (
        MembershipChange(time=1.0, task="worker:2", change="joined", spec_version=2, workers=3),
        MembershipChange(time=2.0, task="worker:3", change="joined", spec_version=3, workers=4),
        MembershipChange(
            time=3.0, task="worker:3", change="left", spec_version=4, step=57, workers=3
        ),
    )
    state = ClusterState(id="c", tasks=(), workers_range=(2, 4), membership=history)
    size, rows = page.evaluate(MEMBERSHIP_ROWS, views.membership(state))
    assert size == "0 workers, elastic 2:4"
    assert [r[1:] for r in rows] == [
        ["worker:3", "left", "57", "4", "3"],
        ["worker:3", "joined", "-", "3", "4"],
        ["worker:2", "joined", "-", "2", "3"],
    ]


def test_the_list_page_shows_the_cluster(site: Site, page: Any) -> None:
    page.goto(site.base + "/")
    page.wait_for_selector(f"#clusters a[href='/clusters/{site.cluster_id}']")
    page.wait_for_function(
        "document.querySelector('#clusters tbody tr td:nth-child(5)').textContent.includes('m')"
    )
    assert "running" in page.text_content("#clusters tbody tr")


def test_metrics_parse_with_prometheus_own_parser(site: Site) -> None:
    wait_until(
        lambda: _figure(site, "worker:0", "step") and _figure(site, "worker:1", "step"),
        60,
        "both workers to report a step",
    )
    code, body, headers = site.get("/metrics")
    assert code == 200 and headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(body)}
    status = {
        s.labels["status"]: s.value
        for s in families["clusterflow_cluster_status"].samples
        if s.labels["cluster"] == site.cluster_id
    }
    assert status["running"] == 1.0 and sum(status.values()) == 1.0
    steps = {
        (s.labels["job"], s.labels["task"]): s.value
        for s in families["clusterflow_task_step"].samples
        if s.labels["cluster"] == site.cluster_id
    }
    assert set(steps) == {("worker", "0"), ("worker", "1")}
    assert all(v > 0 for v in steps.values())
    assert families["clusterflow_task_samples_per_second"].samples[0].value == 50.0
    up = [s.value for s in families["clusterflow_task_up"].samples]
    assert up == [1.0, 1.0]


def test_an_unknown_cluster_is_a_404_page(site: Site, page: Any) -> None:
    for bad in ("0000000000", "..", "%2e%2e", "a%2Fb", "x" * 300):
        code, body, _ = site.get(f"/clusters/{bad}")
        assert code == 404, (bad, code)
        assert "Traceback" not in body and "not found" in body
    response = page.goto(f"{site.base}/clusters/nosuchcluster")
    assert response.status == 404
    assert "no cluster 'nosuchcluster'" in page.text_content("#message")
    code, body, _ = site.get("/api/clusters/nosuchcluster")
    assert code == 404 and json.loads(body)["error"]


def test_actions_need_the_token_even_on_loopback(site: Site) -> None:
    assert site.post(f"/clusters/{site.cluster_id}/stop")[0] == 403
    wrong = {"Authorization": "Bearer " + "x" * len(TOKEN)}
    assert site.post(f"/clusters/{site.cluster_id}/stop", wrong)[0] == 403
    # A cookie alone is not enough for an action (another local page could send one).
    cookie = {"Cookie": f"clusterflow_ui_token={TOKEN}"}
    assert site.post(f"/clusters/{site.cluster_id}/stop", cookie)[0] == 403
    assert site.state()["status"] == "running"
    # A page on another host name that resolves here (DNS rebinding) reads nothing.
    assert site.get("/", {"Host": "attacker.example:8265"})[0] == 403


def test_off_loopback_every_request_needs_the_token(site: Site) -> None:
    # Bound to every interface; the test still talks only to 127.0.0.1.
    proc, url = _start_ui(site.home, "--host", "0.0.0.0")
    try:
        assert f"token={TOKEN}" in url
        base = url.split("/?")[0].replace("0.0.0.0", "127.0.0.1")
        other = Site(base, site.cluster_id, site.home, site.data)
        logs = f"/api/clusters/{site.cluster_id}"
        for path in ("/", logs, f"{logs}/stream", "/metrics"):
            assert other.get(path)[0] == 401, path
        code, body, _ = other.get(logs, {"Authorization": f"Bearer {TOKEN}"})
        assert code == 200 and "worker:0" in json.loads(body)["logs"]
        code, _, headers = other.get(f"/?token={TOKEN}")
        assert code == 200 and "SameSite=Strict" in headers["set-cookie"]
        assert other.get("/metrics", {"Cookie": f"clusterflow_ui_token={TOKEN}"})[0] == 200
    finally:
        _end(proc)


@pytest.fixture(scope="module")
def cache_name(site: Site) -> Iterator[str]:
    """A real cache of the cluster's Parquet file: two partitions held by a cache server."""
    name = "dashcache"
    made = subprocess.run(
        [*CLI, "cache", "create", name, "--from", site.data, "--partitions", "2"],
        capture_output=True,
        text=True,
        env=_env(site.home),
        timeout=60,
        check=False,
    )
    try:
        assert made.returncode == 0, made.stderr
        yield name
    finally:
        subprocess.run(
            [*CLI, "cache", "drop", name],
            capture_output=True,
            env=_env(site.home),
            timeout=60,
            check=False,
        )


def test_studies_and_caches_have_pages(site: Site, cache_name: str, page: Any) -> None:
    import optuna

    study = optuna.create_study(
        study_name="dash-study", storage=f"sqlite:///{site.home / 'studies.db'}"
    )
    study.add_trial(
        optuna.trial.create_trial(
            params={"lr": 0.01},
            distributions={"lr": optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)},
            value=0.75,
            user_attrs={"cluster_id": site.cluster_id},
        )
    )
    code, body, _ = site.get("/studies")
    assert code == 200 and 'href="/studies/dash-study"' in body and "0.75" in body
    code, body, _ = site.get("/studies/dash-study")
    assert code == 200 and f'href="/clusters/{site.cluster_id}"' in body
    assert site.get("/studies/no-such-study")[0] == 404

    code, body, _ = site.get("/caches")
    assert code == 200 and f'href="/caches/{cache_name}"' in body and "400" in body
    code, body, _ = site.get(f"/caches/{cache_name}")
    ranges = [(int(a), int(b)) for a, b in re.findall(r"<td>\[(\d+), (\d+)\)</td>", body)]
    assert code == 200 and len(ranges) == 2  # the two partitions, tiling the 400 records
    assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == 400
    assert site.get("/caches/no-such-cache")[0] == 404
    for path in ("/studies", "/studies/dash-study", "/caches", f"/caches/{cache_name}"):
        page.goto(site.base + path)
        assert page.evaluate(MISALIGNED) == [], path


def test_the_stop_button_stops_the_cluster_and_the_page_shows_it(site: Site, page: Any) -> None:
    page.goto(f"{site.base}/clusters/{site.cluster_id}?token={TOKEN}")
    page.wait_for_selector("#tasks tbody tr[data-task]")
    page.click("#stop")
    page.wait_for_function(
        "document.querySelector('#status').textContent === 'stopped'", timeout=60_000
    )
    assert site.state()["status"] == "stopped"
    assert page.is_disabled("#stop")
    page.goto(site.base + "/")
    assert "stopped" in page.text_content(f"#clusters tr[data-id='{site.cluster_id}']")


def test_a_bad_port_or_a_taken_one_is_a_one_line_error(tmp_path: Path) -> None:
    def ui(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, "ui", *args],
            capture_output=True,
            text=True,
            env=_env(tmp_path),
            timeout=30,
            check=False,
        )

    bad = ui("--port", "70000")
    assert bad.returncode == 2 and bad.stderr == "error: --port must be 0 to 65535, got 70000\n"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        busy = ui("--port", port)
    assert busy.returncode == 2 and busy.stdout == ""
    assert busy.stderr.startswith(f"error: cannot bind the dashboard to 127.0.0.1:{port}: ")
    assert len(busy.stderr.splitlines()) == 1
    assert ui("--interval", "0").returncode == 2

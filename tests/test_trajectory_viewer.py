"""The trajectory viewer, `squall show` and `squall rescore` on a real run: the scheduler, a
runner with the calculator agent and an inference node serving the committed tiny policy (no
trainer: a rollout-only run), to its end. The scheduler keeps each version's attempts in the
run folder; the viewer decodes their recorded token ids with the policy's tokenizer; rescoring
with the agent's own reward gives back the rewards the run recorded.

The browser test clicks through the dashboard's viewer in headless Chromium (Debian's
`chromium` driven by Playwright) and keeps test-artifacts/trajectories.png."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest
import redis
from optional import installed, need
from runner_helpers import SQUALL, Procs, write_jsonl
from test_monitor_dashboard import ARTIFACTS, CHROMIUM, CHROMIUM_FLAGS, _start_dashboard, _stop
from waiting import wait_for

from examples.calc.tasks import generate
from squall.monitor.rollouts import RolloutKeeper, read_kept
from squall.monitor.trajectories import Filters, NotFound, TrajectoryView
from squall.shared import bus, schemas
from squall.shared.keys import GROUP_RUNNERS, Keys
from squall.shared.localredis import free_port

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "examples" / "calc" / "policy"
SAMPLES, GROUP_SIZE = 4, 3


def _traj(run: str, key: int, version: int, reward: float) -> schemas.Trajectory:
    turn = schemas.Turn(model="policy", prompt_ids=schemas.pack_tokens([1, 2]), response_ids=schemas.pack_tokens([3]),
                        response_logprobs=schemas.pack_logprobs([-0.1]), version=version)  # fmt: skip
    return schemas.Trajectory(run=run, task_id=f"g{key}:0", group_id=f"g{key}", sample_id=str(key), index=0,
                              group_size=1, attempt=0, runner_id="r", status="ok", reward=reward, turns=[turn])  # fmt: skip


def test_keeper_bounds_each_version_survives_restart_and_a_torn_tail(tmp_path):
    keeper = RolloutKeeper(tmp_path, per_version=2)
    kept = [keeper.keep(_traj("x", i, i % 2, 0.5), {"i": i}, f"{i}-0") for i in range(6)]
    assert kept == [True, True, True, True, False, False]  # two of v0 (0, 2), two of v1 (1, 3)
    again = RolloutKeeper(tmp_path, per_version=3)  # a restarted scheduler counts what is there
    assert again.keep(_traj("x", 10, 0, 1.0), None, "10-0") and not again.keep(
        _traj("x", 12, 0, 1.0), None, "12-0"
    )
    with open(tmp_path / "rollouts" / "v000001.msgpack", "ab") as out:
        out.write((999).to_bytes(4, "little") + b"torn")  # a crash mid-append
    keys = sorted(x.key for x in read_kept(tmp_path))
    assert keys == ["g0:0#0", "g10:0#0", "g1:0#0", "g2:0#0", "g3:0#0"]
    assert {x.key: x.payload for x in read_kept(tmp_path)}["g2:0#0"] == {"i": 2}
    assert not RolloutKeeper(tmp_path / "off", per_version=0).keep(_traj("x", 1, 0, 1.0), None, "1-0")
    assert not (tmp_path / "off").exists()


@pytest.fixture(scope="module")
def calc_run(redis_url, tmp_path_factory):
    """A finished rollout-only run of the calculator agent on the tiny policy."""
    if not (POLICY / "config.json").exists():
        pytest.skip("the calculator policy is not built (examples/calc/sft.py)")
    tmp = tmp_path_factory.mktemp("calc-run")
    run = f"v{uuid.uuid4().hex[:8]}"
    data = write_jsonl(tmp / "train.jsonl", generate("train", SAMPLES, seed=3))
    port = free_port()
    env = {"SQUALL_RUN__DIR": str(tmp / "run"), "SQUALL_SCHEDULER__HOLD_UNTIL_TRAINED": "false",
           "SQUALL_SCHEDULER__VAL_AT_END": "false", "SQUALL_RUNNER__INFERENCE_URLS": f'["http://127.0.0.1:{port}"]',
           "SQUALL_MODEL__PATH": str(POLICY)}  # fmt: skip
    procs = Procs(redis_url, run, tmp, **env)
    try:
        procs.start("inference", "--model", str(POLICY), "--port", str(port), "--node", "n1")
        client = redis.Redis.from_url(redis_url)
        wait_for(lambda: client.hexists(Keys(run).heartbeats, "inference:n1"), 120, "the inference node")
        procs.start("runner", "--agent", "examples.calc.agent:agent", "--concurrency", "6")
        scheduler = procs.start("scheduler", "--dataset", str(data), "--group-size", str(GROUP_SIZE))
        assert scheduler.wait(240) == 0, Path(scheduler.log_path).read_text()[-3000:]
    finally:
        procs.stop_all()
    return {"run": run, "redis_url": redis_url, "run_dir": tmp / "run", "tmp": tmp, "env": env}


def _squall(*args: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{ROOT}", **env}
    return subprocess.run([*SQUALL, *args], capture_output=True, text=True, timeout=60, cwd=cwd, env=full)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_rescore_with_the_same_reward_gives_the_recorded_values(calc_run):
    out = calc_run["tmp"] / "same.json"
    done = _squall("rescore", "--run", calc_run["run"], "--run-dir", str(calc_run["run_dir"]),
                   "--reward", "observe_rewards:calc", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["attempts"] == SAMPLES * GROUP_SIZE and report["scored"] == report["attempts"]
    assert report["errors"] == 0 and report["overall"]["changed"] == 0
    assert all(a["before"] == a["after"] for a in report["rescored"])
    assert report["overall"]["before"] == report["overall"]["after"]
    assert set(report["by_version"]) == {"0"}  # no trainer: every attempt was sampled by v0
    assert "report:" in done.stdout and "all" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_rescore_with_another_reward_reports_the_change(calc_run):
    out = calc_run["tmp"] / "length.json"
    done = _squall("rescore", "--run", calc_run["run"], "--run-dir", str(calc_run["run_dir"]),
                   "--reward", "observe_rewards:length", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    for a in report["rescored"]:
        assert 0 < a["after"] <= 1 and a["after"] != a["before"]
    assert report["overall"]["changed"] == report["scored"]
    broken = _squall("rescore", "--run", calc_run["run"], "--run-dir", str(calc_run["run_dir"]),
                     "--reward", "observe_rewards:broken", "--out", str(out))  # fmt: skip
    assert broken.returncode == 0 and json.loads(out.read_text())["errors"] == SAMPLES * GROUP_SIZE
    assert "KeyError" in broken.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_rescore_and_show_refuse_bad_input_clearly(calc_run):
    base = ["--run", calc_run["run"], "--run-dir", str(calc_run["run_dir"])]
    missing_module = _squall("rescore", *base, "--reward", "no_such_module:fn")
    assert missing_module.returncode == 2 and "cannot import no_such_module" in missing_module.stderr
    not_callable = _squall("rescore", *base, "--reward", "observe_rewards:not_callable")
    assert not_callable.returncode == 2 and "has no callable 'not_callable'" in not_callable.stderr
    no_colon = _squall("rescore", *base, "--reward", "observe_rewards")
    assert no_colon.returncode == 2 and "package.module:function" in no_colon.stderr
    no_id = _squall("rescore", *base, "--reward", "observe_rewards:calc", "--id", "g99:0#0")
    assert no_id.returncode == 2 and "no kept attempt 'g99:0#0'" in no_id.stderr
    empty = _squall("rescore", "--run", calc_run["run"], "--run-dir", str(calc_run["tmp"] / "nothing"),
                    "--reward", "observe_rewards:calc")  # fmt: skip
    assert empty.returncode == 2 and "--run-dir" in empty.stderr
    show = _squall("show", "trajectory", "g99:0#0", *base, "--redis-url", calc_run["redis_url"])
    assert show.returncode == 2 and "no trajectory 'g99:0#0'" in show.stderr


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_show_lists_and_opens_attempts_decoded(calc_run):
    base = ["--run", calc_run["run"], "--run-dir", str(calc_run["run_dir"]), "--redis-url", calc_run["redis_url"],
            "--model-dir", str(POLICY)]  # fmt: skip
    listing = _squall("show", "trajectories", *base, "--json")
    assert listing.returncode == 0, listing.stderr
    rows = json.loads(listing.stdout)["rows"]
    assert len(rows) == SAMPLES * GROUP_SIZE and {r["ledger"] for r in rows} == {"ok"}
    view = TrajectoryView(redis.Redis.from_url(calc_run["redis_url"]), Keys(calc_run["run"]),
                          str(calc_run["run_dir"]), str(POLICY))  # fmt: skip
    key = max(rows, key=lambda r: r["turns"])["key"]
    detail = view.detail(key)
    first = detail["turns"][0]
    assert detail["payload"]["question"] in first["prompt_text"]  # decoded from the recorded ids
    assert first["trained"] and first["loss_tokens"] == first["response_tokens"] > 0 and first["node"] == "n1"
    if len(detail["turns"]) > 1:  # a tool call, then the tool's result in the next prompt
        assert detail["turns"][0]["tool_calls"] and detail["turns"][1]["prompt_continues"]
    text = _squall("show", "trajectory", key, *base)
    assert text.returncode == 0 and f"attempt {key}" in text.stdout and "--- turn 0" in text.stdout
    assert detail["payload"]["question"] in text.stdout
    group = _squall("show", "group", detail["group_id"], *base)
    assert group.returncode == 0 and group.stdout.count(f"{detail['group_id']}:") == GROUP_SIZE
    only_ok = _squall("show", "trajectories", *base, "--json", "--min-reward", "1")
    assert all(r["reward"] >= 1 for r in json.loads(only_ok.stdout)["rows"])


@pytest.mark.slow
@pytest.mark.browser
@pytest.mark.timeout(400)
def test_viewer_click_through_in_headless_chromium(calc_run):
    need("browser", CHROMIUM is not None, "chromium is not installed (apt-get install chromium)")
    need("browser", installed("playwright"), "playwright is not installed (pip install playwright)")
    from playwright import sync_api

    # A burst of dead letters (malformed tasks a runner's read dead-letters): a stall for the banner.
    client, keys = redis.Redis.from_url(calc_run["redis_url"]), Keys(calc_run["run"])
    reader = bus.GroupConsumer(client, keys.tasks, GROUP_RUNNERS, "runner-z", kind=schemas.Task,
                               deadletter_stream=keys.deadletter)  # fmt: skip
    for _ in range(6):
        client.xadd(keys.tasks, {"m": b"\x93not a task"})
    reader.read(10, block_ms=100)
    port = free_port()
    os.environ.update({"SQUALL_RUN__DIR": str(calc_run["run_dir"]), "SQUALL_MODEL__PATH": str(POLICY)})
    try:
        proc = _start_dashboard(calc_run["redis_url"], calc_run["run"], port)
    finally:
        for name in ("SQUALL_RUN__DIR", "SQUALL_MODEL__PATH"):
            os.environ.pop(name, None)
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
            page = browser.new_page(viewport={"width": 1500, "height": 1200})
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_selector("[data-testid=stalls] [data-kind=deadletters_rising]", timeout=10_000)
            assert "6 dead letters in the last 300s" in page.inner_text("[data-testid=stalls]")
            page.screenshot(path=str(ARTIFACTS / "dashboard-stall.png"), full_page=True)
            page.click("[data-testid=viewer-link]")
            page.wait_for_selector("[data-testid=row]", timeout=10_000)
            assert page.locator("[data-testid=row]").count() == SAMPLES * GROUP_SIZE
            assert page.inner_text("#run") == calc_run["run"]
            page.select_option("select[name=status]", "ok")
            page.click("[data-testid=apply]")
            page.wait_for_function("document.querySelector('#count').textContent.endsWith('of 12')")
            row = page.locator("[data-testid=row]").first
            key = row.get_attribute("data-key")
            row.click()
            page.wait_for_selector("[data-testid=turn]", timeout=10_000)
            assert page.inner_text("[data-testid=detail-key]") == key
            detail = TrajectoryView(None, None, str(calc_run["run_dir"]), str(POLICY)).detail(key)
            assert detail["payload"]["question"] in page.inner_text("[data-testid=prompt] >> nth=0")
            assert page.locator("[data-testid=turn]").count() == len(detail["turns"])
            page.click("[data-testid=open-group]")
            page.wait_for_selector("[data-testid=member]", timeout=10_000)
            assert page.locator("[data-testid=member]").count() == GROUP_SIZE
            page.screenshot(path=str(ARTIFACTS / "trajectories.png"), full_page=True)
            browser.close()
    finally:
        _stop(proc)
    assert (ARTIFACTS / "trajectories.png").stat().st_size > 10_000


def test_live_attempts_are_read_from_the_stream_with_ledger_and_payload(r, run_name, tmp_path):
    """While a run is live: attempts still in `trajectories`, their payload from the open group,
    their ledger state, filters, and a kept record winning over its live copy."""
    from tracking_helpers import tokenizer, trajectory

    from squall.shared.ledger import Ledger

    keys, tok = Keys(run_name), tokenizer()
    made = [trajectory(run_name, key, version, reward, tok) for key, version, reward in
            ((1, 0, 1.0), (2, 1, 0.0), (3, 1, 1.0))]  # fmt: skip
    for t, _, _ in made:
        bus.publish(r, keys.trajectories, t)
    r.hset(keys.groups, "g2", json.dumps({"payload": {"question": "What is 12 * 8?"}}))
    ledger = Ledger(r, keys)
    ledger.move([made[0][0].key], "pending", allowed_from=["new"])
    ledger.move([made[0][0].key], "ok")
    ledger.move([made[0][0].key], "trained")
    RolloutKeeper(tmp_path, 4).keep(made[2][0], {"question": "kept"}, "1-0")
    view = TrajectoryView(r, keys, str(tmp_path), str(POLICY))
    listing = view.list()
    assert listing["total"] == 3 and listing["sources"] == {"kept": 1, "live": 2} and listing["decoded"]
    assert [row["key"] for row in view.list(Filters(ledger="trained"))["rows"]] == ["g1:0#0"]
    assert [row["key"] for row in view.list(Filters(version=1, min_reward=0.5))["rows"]] == ["g3:0#0"]
    detail = view.detail("g2:0#0")
    assert detail["payload"] == {"question": "What is 12 * 8?"} and detail["source"] == "live"
    t, prompt, rest = made[1]
    assert detail["turns"][0]["prompt_text"] == prompt  # decoded from the recorded ids
    assert detail["turns"][0]["tool_calls"] == [{"name": "calculator", "arguments": {"expression": "12 * 8"}}]
    assert (
        detail["turns"][1]["prompt_continues"] and "<tool_response>" in detail["turns"][1]["new_prompt_text"]
    )
    assert view.detail("g3:0#0")["payload"] == {"question": "kept"}
    with pytest.raises(NotFound, match="no trajectory 'g9:0#0'"):
        view.detail("g9:0#0")

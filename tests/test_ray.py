"""Batch jobs on a local Ray cluster (2 replicas of 1 CPU, the default model): the answers of the single-machine
job, each request written exactly once when a replica's process or the driver is killed mid-job."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import child_env
from jobs_support import completion_line, read_records, run_cli, write_batch, write_job
from offload.errors import ConfigError, OffloadError, PlanError
from offload.jobs.batch import COMPLETIONS, Request
from offload.jobs.config import load_config, plan_request
from offload.options import DistributedOptions
from offload.jobs.ray import Dispatch, Slot, check_reachable, import_ray, replicas_that_fit, start_replicas
from offload.jobs.run import run_batch
from offload.jobs.worker import Answer
from offload.planner import Budget
from offload.sampling import SamplingParams

N_REQUESTS = 40
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="needs ray: pip install 'offload[ray]'")


def on_ray(test):
    """A test on the local cluster: marked ray (and slow: it loads the default model), skipped without ray."""
    return pytest.mark.ray(pytest.mark.slow(needs_ray(test)))


def job_config(folder: Path, engine: str = "ray", **distributed) -> Path:
    """40 completions of 2-5 tokens each (greedy, ignore_eos: every answer has its full length)."""
    lines = [completion_line(f"r{i:02d}", f"Item {i}: the story of {'a long ' * (i % 7)}day", max_tokens=2 + i % 4)
             for i in range(N_REQUESTS)]
    write_batch(folder / "in.jsonl", lines)
    return write_job(folder / "job.yaml", model={"path": "default"}, input={"path": "in.jsonl"},
                     output={"path": "out.jsonl"}, sampling={"temperature": 0, "ignore_eos": True},
                     report={"print": False, "progress": False}, engine=engine,
                     distributed={"replicas": 2, "cpus_per_replica": 1, **distributed})


def answers(out: Path) -> dict[str, str]:
    """custom_id -> text, asserting every request is answered exactly once."""
    records = read_records(out)
    ids = Counter(r["custom_id"] for r in records)
    assert set(ids) == {f"r{i:02d}" for i in range(N_REQUESTS)} and max(ids.values()) == 1, ids.most_common(3)
    assert all(r["error"] is None for r in records), [r["error"] for r in records if r["error"]][:2]
    return {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in records}


def n_lines(out: Path) -> int:
    return out.read_bytes().count(b"\n") if out.exists() else 0


@pytest.fixture(scope="module")
def cluster():
    """A Ray cluster of 2 CPUs on this machine, for the module; its address, for drivers in other processes."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"OFFLOAD_PACKED_CACHE": "0"}})
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def single_machine(tmp_path_factory) -> dict[str, str]:
    """The answers of the same job run on this machine alone (engine: local)."""
    folder = tmp_path_factory.mktemp("local")
    run_batch(job_config(folder, engine="local"))
    return answers(folder / "out.jsonl")


@on_ray
def test_two_replicas_give_the_single_machine_answers(cluster, single_machine, tmp_path):
    report = run_batch(job_config(tmp_path))
    assert answers(tmp_path / "out.jsonl") == single_machine
    assert report["requests"]["done"] == N_REQUESTS and report["requests"]["failed"] == 0
    replicas = report["replicas"]
    assert [r["replica"] for r in replicas] == [0, 1] and len({r["pid"] for r in replicas}) == 2
    assert all(r["answered"] > 0 and r["restarts"] == 0 and not r["lost"] for r in replicas)
    assert sum(r["answered"] for r in replicas) == N_REQUESTS
    assert sum(r["report"]["tokens"]["generated"] for r in replicas) == report["tokens"]["generated"]
    assert all(r["plan"]["summary"] and r["report"]["phases"]["decode"]["tokens"] > 0 for r in replicas)
    # two replicas on one node: each plans for half of the RAM the node's default budget gives one process
    half = Budget.for_hardware(plan_request(load_config(tmp_path / "job.yaml")).profile()).cpu_bytes // 2
    assert [r["report"]["memory"]["cpu"]["budget_bytes"] for r in replicas] == [half, half]
    saved = json.loads((tmp_path / "out.report.json").read_text())
    assert saved["replicas"][1]["node"] == replicas[1]["node"] and saved["outputs"]["answered"] == N_REQUESTS


@on_ray
def test_a_replica_killed_mid_job_leaves_every_request_answered_once(cluster, single_machine, tmp_path):
    config = job_config(tmp_path, shard_size=4)  # shards of 4: a replica is always mid-shard until the end
    rng = random.Random(18)
    replicas = start_replicas(load_config(config))
    result = {}

    def run() -> None:
        try:
            result["report"] = run_batch(config, llm=replicas)
        except BaseException as e:  # noqa: BLE001 - shown by the assertion below
            result["error"] = e

    try:
        victim = rng.randrange(2)
        pid = replicas.pids()[victim]
        runner = threading.Thread(target=run)
        runner.start()
        at = rng.randint(2, 24)
        deadline = time.monotonic() + 120
        while n_lines(tmp_path / "out.jsonl") < at and runner.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        runner.join(timeout=180)
        assert not runner.is_alive() and "report" in result, f"no report after the kill at {at} lines: {result}"
        assert replicas.pids()[victim] != pid  # Ray restarted it
    finally:
        replicas.close()
    assert answers(tmp_path / "out.jsonl") == single_machine
    lost = result["report"]["replicas"][victim]
    assert lost["restarts"] == 1, f"the replica was not mid-shard when killed at {at} lines"


@contextmanager
def a_replica_killed_while_it_loads():
    """SIGKILL the first replica seen loading its model (its process title reads ray::Replica.load meanwhile)."""
    killed, stop = [], threading.Event()

    def watch() -> None:
        while not stop.wait(0.01):
            for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
                try:
                    loading = cmdline.read_bytes().startswith(b"ray::Replica.load")
                except OSError:  # the process ended
                    continue
                if loading:
                    os.kill(int(cmdline.parent.name), signal.SIGKILL)
                    return killed.append(int(cmdline.parent.name))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield killed
    finally:
        stop.set()
        watcher.join()
    assert killed, "no replica was seen loading its model"


@on_ray
def test_a_replica_killed_while_it_loads_restarts_unless_restarts_are_exhausted(cluster, single_machine, tmp_path):
    with a_replica_killed_while_it_loads(), pytest.raises(
            OffloadError, match=r"^replica [01] was lost while loading its model \(ActorDiedError\) 1 time\(s\), "
                                r"more than distributed.max_restarts = 0 allows; nothing was written: .*rerun the job$"):
        run_batch(job_config(tmp_path, max_restarts=0))
    assert not (tmp_path / "out.jsonl").exists()
    with a_replica_killed_while_it_loads():
        report = run_batch(job_config(tmp_path))
    assert answers(tmp_path / "out.jsonl") == single_machine
    # the restart is offload's (the load call lost: counted), or Ray's own (the actor restarted and its load task
    # retried under it, which offload does not see): either way the job answered each custom_id once
    assert sorted(r["restarts"] for r in report["replicas"]) in ([0, 0], [0, 1])


@on_ray
def test_driver_killed_then_rerun_resumes_without_repeating(cluster, single_machine, tmp_path):
    config, out = job_config(tmp_path), tmp_path / "out.jsonl"
    driver = subprocess.Popen([sys.executable, "-m", "offload.cli.main", "run", str(config), "--ray", cluster],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    at = random.Random(5).randint(3, 30)
    deadline = time.monotonic() + 180
    while n_lines(out) < at and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    driver.kill()
    _, stderr = driver.communicate(timeout=30)
    assert driver.returncode == -signal.SIGKILL, f"the driver ended before the kill: {stderr[-2000:]}"
    before = [line for line in out.read_text().splitlines(keepends=True) if line.endswith("\n")]
    report = run_batch(config)
    assert report["requests"]["skipped_already_done"] == len(before) >= at
    assert report["requests"]["done"] == N_REQUESTS - len(before)
    assert out.read_text().startswith("".join(before))  # what the killed driver wrote is kept, not redone
    assert answers(out) == single_machine


@on_ray
def test_replicas_that_cannot_start_are_refused_before_anything_is_written(cluster, tmp_path):
    with pytest.raises(ConfigError, match=r"key 'distributed.replicas': 3 replica\(s\) of 1 CPU each do not fit the "
                                          r"Ray cluster, whose nodes hold 2; lower distributed.replicas"):
        run_batch(job_config(tmp_path, replicas=3))
    config = load_config(job_config(tmp_path), {"memory.cpu": "530MiB"})  # 18 MiB beside the 512 MiB baseline
    with pytest.raises(PlanError, match=r"^replica [01] could not start: .* does not fit: .*raise --cpu-memory"):
        run_batch(config)
    assert not (tmp_path / "out.jsonl").exists()


def test_an_address_that_refuses_connections_fails_at_once():
    with pytest.raises(ConfigError, match=r"cannot reach the Ray cluster at distributed.address '127.0.0.1:1' "
                                          r"\(Connection refused\); check the head node's address and port"):
        check_reachable("127.0.0.1:1")
    check_reachable("auto")  # resolved by Ray itself


def test_an_answer_that_arrives_twice_is_written_once():
    written, failed = [], []
    dispatch = Dispatch(None, [], DistributedOptions(), lambda req, a: written.append(req.key),
                        lambda req, message: failed.append(req.key))
    slot = Slot(0, None, {"node": "n"})
    slot.shard = {key: Request(key, 1, COMPLETIONS, SamplingParams(), prompt="x") for key in ("a", "b", "c")}
    answer = Answer([{"index": 0, "text": "text", "logprobs": None, "finish_reason": "length"}], 1, 2)
    for key, result in [("a", answer), ("a", answer), ("b", "too long"), ("b", answer), ("zz", answer)]:
        dispatch.accept(slot, key, result)
    assert written == ["a"] and failed == ["b"] and set(slot.shard) == {"c"}
    dispatch.requeue(slot)  # the replica was lost: c goes back to the queue, and a late answer for it is dropped
    dispatch.accept(slot, "c", answer)
    assert written == ["a"] and [r.key for r in dispatch.queue] == ["c"]
    assert (slot.n_answered, slot.n_failed, slot.n_generated_tokens) == (1, 1, 2)


def test_replicas_that_fit_count_whole_replicas_per_node():
    nodes = [{"Alive": True, "Resources": {"CPU": 8.0, "GPU": 2.0}}, {"Alive": True, "Resources": {"CPU": 3.0}},
             {"Alive": False, "Resources": {"CPU": 64.0}}]
    assert replicas_that_fit(nodes, 2, 0) == 4 + 1
    assert replicas_that_fit(nodes, 1, 1) == 2
    assert replicas_that_fit(nodes, 0.5, 0.5) == 4
    assert replicas_that_fit(nodes, 4, 0) == 2


def test_engine_ray_without_ray_fails_in_one_line_naming_the_extra(tmp_path, monkeypatch):
    config = job_config(tmp_path)
    monkeypatch.setitem(sys.modules, "ray", None)  # what an import of ray does where it is not installed
    with pytest.raises(ConfigError, match=r"pip install 'offload\[ray\]'"):
        import_ray()
    code, message = run_cli("run", config)
    assert code == 2 and "offload[ray]" in message and "Traceback" not in message
    assert message.count("\n") == 1 and not (tmp_path / "out.jsonl").exists()

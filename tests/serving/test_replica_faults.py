"""The replicas' front door under faults, with real processes and real signals (issue: a hung
replica hung every request routed to it while /health said ok). SIGSTOP of the decode replica:
/health says degraded within 2 s, /metrics never waits on it, a stream it was serving ends with
an error event, requests that had not started are served whole by the prefill replica, and no
request waits past its deadline; the hung replica is killed and started again. A replica that
does not get healthy by its start deadline is killed (a real process, without the model's load
time). No process is left after."""
import json
import os
import signal
import threading
import time

import httpx

from helpers import complete as post
from test_replicas import KEY, MODEL, front_door, metric, replica_pids, wait_until

FAULTS = ["--replica-hang-seconds", "3", "--request-timeout", "40"]
AUTH = {"authorization": f"Bearer {KEY}"}


def health(url: str) -> tuple[int, dict]:
    answer = httpx.get(url + "/health", timeout=5)
    return answer.status_code, answer.json()


def test_a_hung_replica_is_taken_out_served_around_killed_and_started_again():
    with front_door(MODEL + FAULTS, 240) as (url, proc):
        prompt = list(range(100, 300))
        stream_end, started, lines = [], threading.Event(), []

        def stream():  # a long stream pinned to the decode replica
            try:
                read()
            except Exception as exc:
                stream_end.append({"reader failed": repr(exc)})

        def read():
            with httpx.stream("POST", url + "/v1/completions", headers={**AUTH, "x-data-parallel-rank": "1"},
                              json={"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True},
                              timeout=60) as answer:
                for line in answer.iter_lines():
                    lines.append(line)
                    started.set()
                    if line.startswith("data: ") and line != "data: [DONE]":
                        stream_end.append(json.loads(line[6:]))

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60)
        decode = replica_pids(proc)[1]
        os.kill(decode, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            wait_until(lambda: health(url)[0] == 503, 2.5, "/health says the decode role is down")
            status, body = health(url)
            assert body["status"] == "degraded" and body["roles_down"] == ["decode"] and body["replicas_up"] == [0]
            began = time.monotonic()
            text = httpx.get(url + "/metrics", headers=AUTH, timeout=5).text
            assert time.monotonic() - began < 2.0 and 'vkv:replica_up{rank="1"} 0' in text
            reader.join(timeout=10)
            assert not reader.is_alive() and stream_end and "error" in stream_end[-1], lines[:5]  # ended with an error event and [DONE]
            answers = [post(url, prompt[:50 + i], key=KEY, timeout=45, max_tokens=4) for i in range(3)]
            assert [a.status_code for a in answers] == [200] * 3  # served whole by the prefill replica
            down = post(url, prompt, key=KEY, headers={"x-data-parallel-rank": "1"}, timeout=10)
            assert down.status_code == 503 and int(down.headers["retry-after"]) >= 1
            # killed at its hang deadline (a stopped process takes only KILL) and started again
            wait_until(lambda: not os.path.exists(f"/proc/{decode}") or _zombie(decode), 15, "the hung replica is killed")
            killed = time.monotonic() - stopped
            assert killed < 3 + 1 + 2 + 3, killed  # hang seconds, a probe, the TERM grace, the loop's tick
        finally:
            if os.path.exists(f"/proc/{decode}"):
                os.kill(decode, signal.SIGCONT)
        wait_until(lambda: health(url)[0] == 200, 120, "the decode replica started again")
        text = httpx.get(url + "/metrics", headers=AUTH).text
        assert metric(text, "vkv:replica_kills_total") == 1 and metric(text, "vkv:replica_restarts_total") == 1
        assert 'vkv:replica_role_fallbacks_total{role="decode"} 3' in text
        assert post(url, prompt, key=KEY, max_tokens=4).status_code == 200


def _zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_start_past_its_deadline_is_killed_and_started_again_with_backoff(monkeypatch):
    """A replica stopped while it started stayed down for good. Here a stand-in process that never
    answers its probes (it sleeps) is judged as the supervisor judges a start."""
    import subprocess

    from engine.serving.dp import replicas as module
    from engine.serving.dp.replicas import Replica, ReplicaSet
    from engine.serving.options import ServerOptions

    supervisor = ReplicaSet.__new__(ReplicaSet)  # its judgement alone: no pool, no replicas of its own
    supervisor.options, supervisor.stopping = ServerOptions(replica_start_timeout=0.5), threading.Event()
    started = []
    monkeypatch.setattr(ReplicaSet, "_start", lambda self, r: started.append(r.rank))
    replica = Replica(0, "both", process=subprocess.Popen(["sleep", "60"]))
    replica.started_at = time.monotonic() - 1.0  # past its start deadline, never healthy
    supervisor._judge(replica, None, time.monotonic())
    assert replica.state == "stopping" and replica.kills == 1
    time.sleep(0.2)
    supervisor._tend(replica, time.monotonic() + module.KILL_GRACE + 0.1)  # TERM answered, or KILL after its grace
    replica.process.wait(timeout=5)
    supervisor._tend(replica, time.monotonic())
    assert replica.state == "down" and replica.backoff == 2 * module.RESTART_GAP  # it died young: backoff doubles
    supervisor._tend(replica, replica.next_start + 0.01)
    assert started == [0] and replica.restarts == 1

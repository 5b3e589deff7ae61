"""Several worker hosts against one PostgreSQL, on simulated hosts (`tests.hosts.netns`).

Each host is a network namespace on a bridge with an address of its own; PostgreSQL and
Redis are servers of the test's own listening on the bridge's address. Three cases:

1. **A host's link cut for longer than its lease, then restored.** Three worker hosts
   share a global limit smaller than their slots together (8 of 3 x 4) and a per-user
   limit (2) while they execute runs of several users. Host A is cut off while it executes
   runs: the others end its leases and execute those runs within the lease plus a claim
   interval (measured on the database's clock); A notices that its leases are gone (it
   counts them, ``leases_lost``), and once its cable is back nothing it wrote for them is
   kept — every run ends once, with one terminal event, its session's events contiguous and
   in submission order. Sampled all along: never more than 8 runs, never more than 2 of one
   user. Then A alone is left, and it claims and completes new runs.
2. **Jobs on Celery hosts.** A run on worker host W1 starts a job (``run_job``); it runs
   on a Celery host (its ``worker`` is that host's node) and completes after W1 is killed:
   its state and output stay readable (Redis, from here), and its record ends completed
   (worker host W2 reconciles it). Jobs submitted from two hosts under one limit (2 at
   once) never run more than 2 at once, on either Celery host.
3. **A Celery job host killed mid-job.** The job is failed with ``job.worker_lost`` within
   ``SAGE_JOB_LOST_SECONDS`` and a sweep, its slot is given back, the run's session gets
   its ``job.failed`` event, and the other Celery host takes the next job.

``make test`` runs the reduced sizes (60 runs); ``SAGE_TORTURE=1`` (``python -m
tests.torture``) the full ones (300 runs of 10 users). Skipped where namespaces cannot be
made (not root), failed under ``CI=true`` then.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest

from scheduling.runs import TERMINAL_EVENTS
from tests.conftest import demo_manifest
from tests.hosts.netns import Site, site

pytestmark = [pytest.mark.slow]

FULL = os.environ.get("SAGE_TORTURE") == "1"


def size(full: Any, reduced: Any) -> Any:
    return full if FULL else reduced


LEASE, HEARTBEAT = 6, 2
GLOBAL, PER_USER, SLOTS = 8, 2, 4
USERS, SESSIONS, RUNS = size((10, 3, 10), (6, 2, 5))
WORDS, TOKEN_DELAY_MS = 8, 120  # about 0.85 s of streaming per run
# Seconds after its lease ran out (database clock) by which a dead host's run is taken
# back: a claim looks for dead leases every second, an idle worker polls every second,
# with room for a loaded machine.
RECLAIM_BOUND = 6.0
# A run A claimed at most this long before the cut is far from done (its streaming alone
# takes about 0.85 s), so the cut costs A that run.
STARTED_WITHIN = 0.3
# How long the cut lasts: longer than the lease, and long enough to see it reclaimed.
CUT_SECONDS = LEASE + 2

WORKER_ENV = {
    "SAGE_SERVER_MAX_CONCURRENT_RUNS": GLOBAL,
    "SAGE_SERVER_MAX_CONCURRENT_RUNS_PER_USER": PER_USER,
    "SAGE_WORKER_CONCURRENT_RUNS": SLOTS,
    "SAGE_LEASE_SECONDS": LEASE,
    "SAGE_HEARTBEAT_SECONDS": HEARTBEAT,
    "SAGE_SHUTDOWN_GRACE_SECONDS": 2,
}


@pytest.fixture(scope="module")
def the_site(tmp_path_factory) -> Iterator[Site]:
    with site(tmp_path_factory.mktemp("hosts")) as made:
        yield made


@pytest.fixture
def hosts_site(the_site: Site) -> Iterator[Site]:
    """The module's site; the processes a test started are stopped after it."""
    first = len(the_site.children)
    yield the_site
    for child in reversed(the_site.children[first:]):
        child.stop(15)


# ------------------------------------------------------------------------------ reading


class Sampler(threading.Thread):
    """Reads the running root runs per user and per lease owner, over and over, until
    stopped: the most seen in all, for one user, and for one worker."""

    def __init__(self, the_site: Site) -> None:
        super().__init__(name="quota-sampler", daemon=True)
        self.site = the_site
        self.stopped = threading.Event()
        self.samples = 0
        self.max_total = 0
        self.max_user = 0
        self.max_worker: dict[str, int] = {}

    def run(self) -> None:
        while not self.stopped.is_set():
            rows = self.site.rows.query(
                "SELECT owner_id, lease_owner, count(*) FROM scheduling_run "
                "WHERE status = 'running' AND parent_id IS NULL GROUP BY owner_id, lease_owner"
            )
            if rows is not None:
                self.samples += 1
                users: dict[Any, int] = {}
                workers: dict[str, int] = {}
                for owner, worker, n in rows:
                    users[owner] = users.get(owner, 0) + n
                    workers[worker] = workers.get(worker, 0) + n
                self.max_total = max(self.max_total, sum(users.values()))
                self.max_user = max([self.max_user, *users.values()])
                for worker, n in workers.items():
                    self.max_worker[worker] = max(self.max_worker.get(worker, 0), n)
            time.sleep(0.05)

    def stop(self) -> None:
        self.stopped.set()
        self.join(10)


def statuses(the_site: Site, run_ids: list[str]) -> dict[str, int] | None:
    rows = the_site.rows.query(
        "SELECT status, count(*) FROM scheduling_run WHERE id = ANY(%s::uuid[]) GROUP BY status",
        run_ids,
    )
    return None if rows is None else dict(rows)


def all_completed(the_site: Site, run_ids: list[str]) -> bool:
    return statuses(the_site, run_ids) == {"completed": len(run_ids)}


def held_by(
    the_site: Site, worker_id: str, started_within: float | None = None
) -> list[tuple[str, datetime]]:
    """The runs ``worker_id`` holds a lease of: (run id, lease expiry by the database);
    with ``started_within``, only those it claimed at most that many seconds ago."""
    rows = the_site.rows.query(
        "SELECT id::text, lease_expires_at FROM scheduling_run "
        "WHERE status = 'running' AND lease_owner = %s"
        " AND (%s::float8 IS NULL OR started_at > clock_timestamp() - %s * interval '1 second')",
        worker_id,
        started_within,
        started_within,
    )
    return rows or []


def assert_each_run_once(the_site: Site, run_ids: list[str]) -> None:
    """Every run completed once: one terminal event each; each session's events
    contiguous, its runs completed in submission order."""
    terminal = the_site.rows.query(
        "SELECT r.id::text, count(e.id) FROM scheduling_run r LEFT JOIN scheduling_event e "
        "ON e.run_id = r.id AND e.type = ANY(%s) WHERE r.id = ANY(%s::uuid[]) GROUP BY r.id",
        list(TERMINAL_EVENTS.values()),
        run_ids,
    )
    assert terminal is not None and len(terminal) == len(run_ids)
    wrong = {pk: n for pk, n in terminal if n != 1}
    assert not wrong, f"runs without exactly one terminal event: {wrong}"
    sessions = the_site.rows.query(
        "SELECT s.id::text, s.persisted_events, array_agg(e.seq ORDER BY e.seq),"
        " array_agg(e.run_id::text ORDER BY e.seq) FILTER (WHERE e.type = 'run.completed')"
        " FROM scheduling_session s JOIN scheduling_event e ON e.session_id = s.id"
        " WHERE s.id IN (SELECT session_id FROM scheduling_run WHERE id = ANY(%s::uuid[]))"
        " GROUP BY s.id",
        run_ids,
    )
    assert sessions
    order = {pk: i for i, pk in enumerate(run_ids)}
    for session_id, persisted, seqs, completed in sessions:
        assert seqs == list(range(1, len(seqs) + 1)), f"session {session_id}: seqs {seqs}"
        assert persisted == len(seqs), f"session {session_id}: persisted {persisted}"
        assert completed == sorted(completed, key=order.__getitem__), (
            f"session {session_id}: runs completed out of submission order"
        )


def db_now(the_site: Site) -> datetime:
    rows = the_site.rows.query("SELECT clock_timestamp()")
    assert rows is not None
    return rows[0][0]


# ------------------------------------------------------------------------------ 1: a cut link


def test_a_host_cut_off_longer_than_its_lease_loses_its_runs_to_the_others_and_comes_back(
    hosts_site: Site,
):
    s = hosts_site
    users = [f"cut-user{i}" for i in range(USERS)]
    s.call(
        "setup",
        users=users,
        models={
            "steady": {
                "token_delay_ms": TOKEN_DELAY_MS,
                "script": [{"text": " ".join(["steady"] * WORDS)}],
            }
        },
        manifest=demo_manifest(name="hosts", model="steady", tools=[]),
    )
    a, b, c = (s.host(name) for name in ("a", "b", "c"))
    workers = {host.name: s.worker(host, **WORKER_ENV) for host in (a, b, c)}
    ids = s.wait(
        lambda: (
            all(s.worker_id(w) for w in workers.values())
            and {name: s.worker_id(w) for name, w in workers.items()}
        ),
        timeout=90,
        message="three workers to publish their snapshots",
        running=tuple(workers.values()),
    )

    sampler = Sampler(s)
    sampler.start()
    try:
        plan = [[user, SESSIONS, RUNS] for user in users]
        run_ids = s.call("submit", plan=plan, package="hosts")["runs"]
        assert len(run_ids) == USERS * SESSIONS * RUNS

        # Cut A while it executes a run it has only just claimed: that run's streaming
        # (WORDS tokens, TOKEN_DELAY_MS apart) cannot end before the cable is out, so A
        # cannot finish it and it is the others' to take back. (A run A was about to finish
        # may still complete: its commit, sent whole before the cut, lands — see below.)
        held = s.wait(
            lambda: held_by(s, ids["a"], started_within=STARTED_WITHIN),
            timeout=60,
            message="host A to execute runs",
            running=tuple(workers.values()),
        )
        a.cut()
        cut_at = time.monotonic()
        time.sleep(0.5)  # a renewal on its way when the cable came out cannot land
        held = dict(held_by(s, ids["a"]))
        assert held, "host A held no run when it was cut off"
        last_expiry = max(held.values())

        def taken_back() -> datetime | None:
            rows = s.rows.query(
                "SELECT count(*) FROM scheduling_run WHERE id = ANY(%s::uuid[])"
                " AND status = 'running' AND lease_owner = %s",
                list(held),
                ids["a"],
            )
            return db_now(s) if rows is not None and rows[0][0] == 0 else None

        reclaimed_at = s.wait(
            taken_back,
            timeout=LEASE + RECLAIM_BOUND + 30,
            message=lambda: f"host A's runs {sorted(held)} to be taken back",
            running=(workers["b"], workers["c"]),
        )
        reclaim_delay = (reclaimed_at - last_expiry).total_seconds()
        assert reclaim_delay <= RECLAIM_BOUND, (
            f"host A's runs were taken back {reclaim_delay:.1f}s after their lease ran out"
        )
        time.sleep(max(0.0, CUT_SECONDS - (time.monotonic() - cut_at)))
        a.restore()

        s.wait(
            lambda: all_completed(s, run_ids),
            timeout=size(400, 150),
            message=lambda: f"every run to complete ({statuses(s, run_ids)})",
            running=(workers["b"], workers["c"]),
        )
    finally:
        sampler.stop()

    # Quotas held across the three hosts, and the samples saw them reached.
    assert sampler.samples > 20
    assert sampler.max_total == GLOBAL, sampler.max_total
    assert sampler.max_user == PER_USER, sampler.max_user
    assert max(sampler.max_worker.values()) <= SLOTS, sampler.max_worker
    assert_each_run_once(s, run_ids)
    again = s.rows.query(
        "SELECT id::text, attempts, crashes, status, finished_at FROM scheduling_run"
        " WHERE id = ANY(%s::uuid[])",
        list(held),
    )
    assert again, held

    def reclaimed(attempts: int, crashes: int) -> bool:
        return attempts >= 2 and crashes >= 1

    def finished_by_a(run_id: str, attempts: int, crashes: int, status: str, at: Any) -> bool:
        # Host A's last group commit was on the wire when the cable came out and landed
        # (one round trip, COMMIT included): fenced by the lease A held, so before it ran out.
        return (attempts, crashes, status) == (1, 0, "completed") and at <= held[run_id]

    assert all(
        reclaimed(attempts, crashes) or finished_by_a(run_id, attempts, crashes, status, at)
        for run_id, attempts, crashes, status, at in again
    ), again
    lost_runs = [row for row in again if reclaimed(row[1], row[2])]
    assert lost_runs, again
    # The others executed runs all along (neither starved while the third took all).
    for name in ("b", "c"):
        capacity = s.snapshot(workers[name])
        assert capacity and capacity["runs"]["completed"] > 0, (name, capacity)

    # A came back: it noticed that its leases were lost (and wrote nothing of them: each
    # run ended once, above), and it publishes again.
    def a_back() -> dict[str, Any] | None:
        capacity = s.snapshot(workers["a"])
        fresh = s.rows.query(
            "SELECT clock_timestamp() - heartbeat_at < interval '5 seconds'"
            " FROM scheduling_workersnapshot WHERE worker_id = %s",
            ids["a"],
        )
        lost = capacity["scheduler"]["leases_lost"] if capacity else 0
        if fresh and fresh[0][0] and lost >= len(lost_runs):
            return capacity
        return None

    back = s.wait(
        a_back,
        timeout=90,
        message=lambda: f"host A to report its lost leases ({s.snapshot(workers['a'])})",
        running=(workers["a"],),
    )
    completed_before = back["runs"]["completed"]

    # A alone: it claims and completes new runs.
    for name in ("b", "c"):
        assert s.stop(workers[name]) == 0, workers[name].tail()
    after = s.call("submit", plan=[[users[0], 1, 2], [users[1], 1, 2]], package="hosts")["runs"]
    s.wait(
        lambda: all_completed(s, after),
        timeout=90,
        message=lambda: f"host A alone to complete new runs ({statuses(s, after)})",
        running=(workers["a"],),
    )
    capacity = s.wait(
        lambda: (
            (c := s.snapshot(workers["a"])) and c["runs"]["completed"] >= completed_before + 4 and c
        ),
        timeout=30,
        message="host A's snapshot to count the new runs",
        running=(workers["a"],),
    )
    assert capacity["runs"]["completed"] >= completed_before + len(after)
    assert workers["a"].alive
    print(
        f"\n[hosts] {len(run_ids)} runs on 3 hosts; host A cut off holding {len(held)} run(s), "
        f"taken back {reclaim_delay:.1f}s after the lease ran out; A lost "
        f"{back['scheduler']['leases_lost']} lease(s); quota samples {sampler.samples}"
    )


# ------------------------------------------------------------------------------ 2, 3: jobs

JOB_LOST_SECONDS = 3
JOBS_PREFIX = "sage:jobs"
LIMIT_JOBS = size(12, 4)  # per submitting host, at most 2 at once in all


def job_env(the_site: Site) -> dict[str, Any]:
    return {
        "REDIS_URL": the_site.redis_url,
        "SAGE_JOB_RUNTIME": "celery",
        "SAGE_JOB_LOST_SECONDS": JOB_LOST_SECONDS,
        **WORKER_ENV,
    }


def job_model(seconds: float) -> dict[str, Any]:
    """A scripted model whose agent starts a ``sleep`` job of ``seconds`` (it first writes
    "hello from a job"), then says so."""
    call = {
        "name": "run_job",
        "arguments": {
            "kind": "sleep",
            "input": {"seconds": seconds, "chunks": ["hello from a job"]},
        },
    }
    return {"script": [{"text": "", "tool_calls": [call]}, {"text": "Started it."}]}


def redis_client(the_site: Site) -> Any:
    import redis

    return redis.Redis.from_url(the_site.redis_url, socket_timeout=5, decode_responses=True)


def job_of(the_site: Site, run_id: str) -> tuple[str, str, Any] | None:
    """The job record of ``run_id``: (job id, state, error code)."""
    rows = the_site.rows.query(
        "SELECT job_id, state, error ->> 'code' FROM agents_jobrecord WHERE run_id = %s", run_id
    )
    return rows[0] if rows else None


def start_job(the_site: Site, redis: Any, package: str, worker: Any) -> tuple[str, str, dict]:
    """A run on ``package`` (its agent starts a job) executed by ``worker``: (run id, job
    id, the job's Redis row once a Celery worker started it)."""
    run = the_site.call("submit", plan=[["jobs-user", 1, 1]], package=package)["runs"][0]
    job_id = the_site.wait(
        lambda: (job := job_of(the_site, run)) and job[0],
        timeout=60,
        message=f"a run on {package} to start a job",
        running=(worker,),
    )
    row = the_site.wait(
        lambda: (r := redis.hgetall(f"{JOBS_PREFIX}:job:{job_id}")) and r.get("worker") and r,
        timeout=60,
        message="the job to start on a Celery host",
    )
    return run, job_id, row


def celery_ready(child: Any) -> bool:
    return " ready." in child.output()


def test_jobs_run_on_celery_hosts_outlive_their_submitter_and_a_killed_job_host(
    hosts_site: Site,
):
    s = hosts_site
    redis = redis_client(s)
    env = job_env(s)
    s.call(
        "setup",
        users=["jobs-user"],
        models={"jobber": job_model(4)},
        manifest=demo_manifest(name="jobs", model="jobber", tools=["run_job", "job_status"]),
    )
    s.call(
        "setup",
        users=["jobs-user"],
        models={"long-jobber": job_model(600)},
        manifest=demo_manifest(name="long-jobs", model="long-jobber", tools=["run_job"]),
    )
    w1, w2, c1, c2 = (s.host(name) for name in ("w1", "w2", "c1", "c2"))
    celery = {host.name: s.celery(host, **env) for host in (c1, c2)}
    first = s.worker(w1, **env)
    s.wait(
        lambda: all(celery_ready(c) for c in celery.values()) and s.worker_id(first),
        timeout=90,
        message="two Celery hosts and worker host W1 to start",
        running=(first, *celery.values()),
    )

    # --- 2a: a job submitted on W1 runs on a Celery host, and outlives W1.
    run, job_id, row = start_job(s, redis, "jobs", first)
    assert row["state"] == "running"
    ran_on = row["worker"].split("@")[0]
    assert ran_on in ("c1", "c2"), row["worker"]
    first.proc.kill()  # the submitting host is gone
    first.proc.wait(10)
    s.wait(
        lambda: redis.hget(f"{JOBS_PREFIX}:job:{job_id}", "state") == "completed",
        timeout=60,
        message="the job to complete on its Celery host after W1 died",
    )
    second = s.worker(w2, **env)  # reconciles the records nobody watched
    s.wait(
        lambda: job_of(s, run) == (job_id, "completed", None),
        timeout=90,
        message=lambda: f"W2 to record the job's end (record {job_of(s, run)})",
        running=(second,),
    )
    snapshot, output = asyncio.run(read_job(s, job_id))
    assert (snapshot.state.value, output) == ("completed", "hello from a job")

    def job_events_of_run() -> list[str]:
        types = s.rows.query(
            "SELECT type FROM scheduling_event WHERE run_id = %s ORDER BY seq", run
        )
        return [t for (t,) in types if t.startswith("job.")]

    # The record is written before the event (a reader of the event finds the job), and an
    # end refused while W1's lease held the run is recorded at a later reconciliation.
    s.wait(
        lambda: "job.completed" in job_events_of_run(),
        timeout=90,
        message=lambda: f"W2 to announce the job's end (events {job_events_of_run()})",
        running=(second,),
    )
    job_events = job_events_of_run()
    # job.started when W1 saw the job start before it died.
    assert job_events in (
        ["job.created", "job.completed"],
        ["job.created", "job.started", "job.completed"],
    ), job_events

    # --- 2b: jobs submitted on two hosts share one limit (2 at once) on the Celery hosts.
    limits = LimitSampler(redis)
    limits.start()
    try:
        submitters = [
            s._start(
                f"submitter-{host.name}",
                host,
                [sys.executable, "-c", SUBMIT_JOBS, host.name, str(LIMIT_JOBS)],
                s.env(REDIS_URL=s.redis_url),
            )
            for host in (w1, w2)
        ]
        s.wait(
            lambda: all(not c.alive for c in submitters),
            timeout=size(120, 60),
            message="the submitters' jobs to finish",
        )
    finally:
        limits.stop()
    for child in submitters:
        assert child.returncode == 0, child.tail()
    done = [line for c in submitters for line in c.output().splitlines() if line.startswith("job ")]
    assert len(done) == 2 * LIMIT_JOBS
    assert {line.split()[2] for line in done} == {"completed"}
    assert {line.split()[3].split("@")[0] for line in done} <= {"c1", "c2"}
    assert limits.max_running == 2, limits.max_running

    # --- 3: the Celery host running a job is killed mid-job.
    run, job_id, row = start_job(s, redis, "long-jobs", second)
    victim = row["worker"].split("@")[0]
    survivor = ({"c1", "c2"} - {victim}).pop()
    celery[victim].proc.kill()
    celery[victim].proc.wait(10)
    s.wait(
        lambda: job_of(s, run) == (job_id, "failed", "job.worker_lost"),
        timeout=JOB_LOST_SECONDS + 30,
        message=lambda: f"the killed host's job to be failed as lost ({job_of(s, run)})",
        running=(second,),
    )
    assert redis.hget(f"{JOBS_PREFIX}:job:{job_id}", "state") == "failed"
    assert (redis.get(f"{JOBS_PREFIX}:running"), redis.get(f"{JOBS_PREFIX}:admitted")) == (
        "0",
        "0",
    )
    types = s.rows.query("SELECT type FROM scheduling_event WHERE run_id = %s", run)
    assert ("job.failed",) in types
    # The other Celery host takes the next job.
    run = s.call("submit", plan=[["jobs-user", 1, 1]], package="jobs")["runs"][0]
    s.wait(
        lambda: (job := job_of(s, run)) and job[1] == "completed",
        timeout=60,
        message="the next job to complete on the surviving Celery host",
        running=(second, celery[survivor]),
    )
    job_id = job_of(s, run)[0]
    assert redis.hget(f"{JOBS_PREFIX}:job:{job_id}", "worker").split("@")[0] == survivor
    redis.close()


async def read_job(the_site: Site, job_id: str) -> tuple[Any, str]:
    """The job's snapshot and output, read from Redis here (no worker host involved)."""
    from agents.jobs import CeleryJobRuntime, JobCursor

    runtime = CeleryJobRuntime(redis_url=the_site.redis_url, key_prefix=JOBS_PREFIX)
    try:
        snapshot = await runtime.inspect(job_id)
        chunks = await runtime.read_output(JobCursor(job_id=job_id))
        return snapshot, b"".join(c.data for c in chunks).decode()
    finally:
        await runtime.close()


# Submits N one-second sleep jobs from this host under a limit of 2 running at once (its
# own key prefix), waits for each, prints "job <id> <state> <worker>".
SUBMIT_JOBS = """
import asyncio, sys
from agents.jobs import CeleryJobRuntime, JobSpec

async def main(host, count):
    runtime = CeleryJobRuntime(key_prefix="sage:limits", kinds={"sleep"}, max_concurrent_jobs=2)
    handles = [
        await runtime.submit(
            JobSpec(owner_run_id=f"limits-{host}", kind="sleep", payload={"seconds": 1})
        )
        for _ in range(count)
    ]
    for handle in handles:
        done = await runtime.wait(handle.job_id)
        row = await runtime.store.row(handle.job_id)
        print("job", handle.job_id, done.state.value, row[b"worker"].decode(), flush=True)
    await runtime.close()

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


class LimitSampler(threading.Thread):
    """The most jobs of the ``sage:limits`` prefix seen running at once (its counter and
    its rows), until stopped."""

    def __init__(self, redis: Any) -> None:
        super().__init__(name="job-limit-sampler", daemon=True)
        self.redis = redis
        self.stopped = threading.Event()
        self.max_running = 0

    def run(self) -> None:
        while not self.stopped.is_set():
            counter = int(self.redis.get("sage:limits:running") or 0)
            keys = list(self.redis.scan_iter(match="sage:limits:job:*", count=1000))
            states = [self.redis.hget(key, "state") for key in keys]
            self.max_running = max(self.max_running, counter, states.count("running"))
            time.sleep(0.02)

    def stop(self) -> None:
        self.stopped.set()
        self.join(10)

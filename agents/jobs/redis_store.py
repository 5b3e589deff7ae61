"""Job rows, output and admission counters in Redis, shared by ``CeleryJobRuntime`` and its tasks.

Every state change is one Lua script, so admission (50 concurrent submits against 3 slots),
output caps and terminal transitions are atomic across processes and hosts. Times come from
Redis ``TIME`` so hosts with skewed clocks agree on retention.

Keys (``P`` = key prefix):

- ``P:job:{id}`` hash: the row (spec, state, counters, caps, result)
- ``P:out:{id}`` list of output entries ``stream\\n offset\\n time\\n data``
- ``P:outidx:{id}`` zset, score = chunk offset, member = list index (cursor → chunk lookup)
- ``P:run:{run}`` zset of the run's job ids by creation time
- ``P:idem`` hash ``run\\x1fkey`` → job id; ``P:terminal`` zset job id by end time
- ``P:admitted``, ``P:running``, ``P:rows``, ``P:agg:bytes``, ``P:agg:chunks`` counters
- ``P:tomb:{id}`` a purged/evicted row, kept briefly so ``wait`` can still answer
- ``P:live`` zset job id by the time its worker must have reported by (its heartbeat)

A started job carries the name of the Celery worker running it (``worker``) and is kept in
``P:live`` while that worker beats for it (`RedisJobStore.beat`, from the task). A job whose
worker misses its time — the host died, was cut off, or was killed mid-job — is failed
(``job.worker_lost``) by the next sweep of any process, which gives its slot back: the
limits keep holding across hosts. A worker that comes back finds its job ended and stops it
(its late output and end are refused as for any terminal job).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from redis.asyncio import Redis

from agents.jobs.base import (
    TERMINAL_STATES,
    JobCursor,
    JobExecutionAffinity,
    JobLimits,
    JobOutputChunk,
    JobPauseBehavior,
    JobSnapshot,
    JobSpec,
    JobState,
    JobStream,
    worker_lost_error,
)

TOMBSTONE_SECONDS = 600

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

# Evicts one terminal row: returns its share of the aggregate caps, frees its idempotency
# key, and keeps the row (without output) as a short-lived tombstone for ``wait``.
_EVICT = (
    """
local function evict(p, id)
  local jk = p .. ':job:' .. id
  local f = redis.call('HMGET', jk, 'owner_run_id', 'idempotency_key', 'output_bytes',
                       'output_chunks')
  redis.call('ZREM', p .. ':terminal', id)
  redis.call('ZREM', p .. ':live', id)
  if not f[1] then return 0 end
  redis.call('DECRBY', p .. ':agg:bytes', tonumber(f[3]))
  redis.call('DECRBY', p .. ':agg:chunks', tonumber(f[4]))
  redis.call('DECR', p .. ':rows')
  redis.call('DEL', p .. ':out:' .. id, p .. ':outidx:' .. id)
  redis.call('ZREM', p .. ':run:' .. f[1], id)
  if f[2] and f[2] ~= '' then
    local ik = f[1] .. '\\31' .. f[2]
    if redis.call('HGET', p .. ':idem', ik) == id then redis.call('HDEL', p .. ':idem', ik) end
  end
  redis.call('RENAME', jk, p .. ':tomb:' .. id)
  redis.call('EXPIRE', p .. ':tomb:' .. id, """
    + str(TOMBSTONE_SECONDS)
    + """)
  return 1
end
"""
)

_SUBMIT = (
    _NOW
    + """
local p, id, run, idem = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if idem ~= '' then
  local existing = redis.call('HGET', p .. ':idem', run .. '\\31' .. idem)
  if existing then return {'existing', existing} end
end
local admitted = tonumber(redis.call('GET', p .. ':admitted') or '0')
if admitted >= tonumber(ARGV[5]) then return {'full', tostring(admitted)} end
local rows = tonumber(redis.call('GET', p .. ':rows') or '0')
if rows >= tonumber(ARGV[6]) then return {'capacity', tostring(rows)} end
redis.call('INCR', p .. ':admitted')
redis.call('INCR', p .. ':rows')
local jk = p .. ':job:' .. id
redis.call('HSET', jk, 'created_at', tostring(now), 'updated_at', tostring(now),
           'state', 'created', 'output_bytes', 0, 'output_chunks', 0, 'output_truncated', 0,
           'cancel', 0, 'slot', 0, unpack(ARGV, 7))
redis.call('ZADD', p .. ':run:' .. run, now, id)
if idem ~= '' then redis.call('HSET', p .. ':idem', run .. '\\31' .. idem, id) end
return {'created', id}
"""
)

_EMIT = (
    _NOW
    + """
local p, id, stream, data = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local jk = p .. ':job:' .. id
local f = redis.call('HMGET', jk, 'state', 'output_bytes', 'output_chunks', 'max_bytes',
                     'max_chunks', 'agg_max_bytes', 'agg_max_chunks')
if not f[1] then return -1 end
if f[1] == 'completed' or f[1] == 'failed' or f[1] == 'killed' then return -1 end
local ob, oc = tonumber(f[2]), tonumber(f[3])
local gb = tonumber(redis.call('GET', p .. ':agg:bytes') or '0')
local gc = tonumber(redis.call('GET', p .. ':agg:chunks') or '0')
local room = math.min(tonumber(f[4]) - ob, tonumber(f[6]) - gb)
if room <= 0 or oc >= tonumber(f[5]) or gc >= tonumber(f[7]) then
  redis.call('HSET', jk, 'output_truncated', 1)
  return 0
end
if #data > room then
  data = string.sub(data, 1, room)
  redis.call('HSET', jk, 'output_truncated', 1)
end
redis.call('RPUSH', p .. ':out:' .. id,
           stream .. '\\n' .. string.format('%d', ob) .. '\\n' .. tostring(now) .. '\\n' .. data)
redis.call('ZADD', p .. ':outidx:' .. id, ob, oc)
redis.call('HINCRBY', jk, 'output_bytes', #data)
redis.call('HINCRBY', jk, 'output_chunks', 1)
redis.call('INCRBY', p .. ':agg:bytes', #data)
redis.call('INCR', p .. ':agg:chunks')
return #data
"""
)

# created → running when a cluster-wide slot is free: 'started', 'busy' (retry) or 'gone'.
_START = (
    _NOW
    + """
local p, id = ARGV[1], ARGV[2]
local jk = p .. ':job:' .. id
local f = redis.call('HMGET', jk, 'state', 'cancel', 'max_concurrent')
if f[1] ~= 'created' or f[2] == '1' then return 'gone' end
local running = tonumber(redis.call('GET', p .. ':running') or '0')
if running >= tonumber(f[3]) then return 'busy' end
redis.call('INCR', p .. ':running')
redis.call('HSET', jk, 'state', 'running', 'slot', 1, 'started', 1,
           'updated_at', tostring(now), 'worker', ARGV[3])
redis.call('ZADD', p .. ':live', now + tonumber(ARGV[4]), id)
return 'started'
"""
)

_FINISH = (
    _NOW
    + """
local p, id, state = ARGV[1], ARGV[2], ARGV[3]
local jk = p .. ':job:' .. id
local f = redis.call('HMGET', jk, 'state', 'slot')
if not f[1] then return 0 end
if f[1] == 'completed' or f[1] == 'failed' or f[1] == 'killed' then return 0 end
if f[2] == '1' then redis.call('DECR', p .. ':running') end
redis.call('DECR', p .. ':admitted')
redis.call('HSET', jk, 'state', state, 'slot', 0, 'updated_at', tostring(now),
           'terminal_at', tostring(now), unpack(ARGV, 4))
redis.call('ZADD', p .. ':terminal', now, id)
redis.call('ZREM', p .. ':live', id)
return 1
"""
)

# The running job's worker reports: 1 (its time moves on), or 0 when the job ended
# meanwhile (failed as lost, or killed) — the worker then stops it.
_BEAT = (
    _NOW
    + """
local p, id = ARGV[1], ARGV[2]
local state = redis.call('HGET', p .. ':job:' .. id, 'state')
if state ~= 'running' and state ~= 'stopping' and state ~= 'orphaned' then
  redis.call('ZREM', p .. ':live', id)
  return 0
end
redis.call('ZADD', p .. ':live', now + tonumber(ARGV[3]), id)
return 1
"""
)

# Started jobs whose worker missed its time end failed (ARGV[5], the error), slot given back.
_LOST = """
for _, id in ipairs(redis.call('ZRANGEBYSCORE', p .. ':live', '-inf', now)) do
  local jk = p .. ':job:' .. id
  local f = redis.call('HMGET', jk, 'state', 'slot')
  redis.call('ZREM', p .. ':live', id)
  if f[1] == 'running' or f[1] == 'stopping' or f[1] == 'orphaned' then
    if f[2] == '1' then redis.call('DECR', p .. ':running') end
    redis.call('DECR', p .. ':admitted')
    redis.call('HSET', jk, 'state', 'failed', 'slot', 0, 'updated_at', tostring(now),
               'terminal_at', tostring(now), 'error', ARGV[5])
    redis.call('ZADD', p .. ':terminal', now, id)
    n = n + 1
  end
end
"""

# A created job dies at once ('killed'); a started one gets the cooperative flag ('stopping').
_CANCEL = (
    _NOW
    + """
local p, id, err = ARGV[1], ARGV[2], ARGV[3]
local jk = p .. ':job:' .. id
local state = redis.call('HGET', jk, 'state')
if not state then return 'missing' end
if state == 'completed' or state == 'failed' or state == 'killed' then return state end
if state == 'created' then
  redis.call('DECR', p .. ':admitted')
  redis.call('HSET', jk, 'state', 'killed', 'cancel', 1, 'error', err,
             'updated_at', tostring(now), 'terminal_at', tostring(now))
  redis.call('ZADD', p .. ':terminal', now, id)
  return 'killed'
end
redis.call('HSET', jk, 'cancel', 1, 'updated_at', tostring(now), 'kill_error', err)
if state ~= 'orphaned' then redis.call('HSET', jk, 'state', 'stopping') end
return 'stopping'
"""
)

_ORPHAN = (
    _NOW
    + """
local jk = ARGV[1] .. ':job:' .. ARGV[2]
local state = redis.call('HGET', jk, 'state')
if not state then return 'missing' end
if state ~= 'running' and state ~= 'stopping' then return state end
redis.call('HSET', jk, 'state', 'orphaned', 'updated_at', tostring(now))
return 'ok'
"""
)

_ADOPT = (
    _NOW
    + """
local jk = ARGV[1] .. ':job:' .. ARGV[2]
local f = redis.call('HMGET', jk, 'state', 'owner_run_id', 'cancel')
if not f[1] then return 'missing' end
if f[1] ~= 'orphaned' then return f[1] end
if f[2] ~= ARGV[3] then return 'owner' end
local target = 'running'
if f[3] == '1' then target = 'stopping' end
redis.call('HSET', jk, 'state', target, 'updated_at', tostring(now))
return 'ok'
"""
)

_SWEEP = (
    _NOW
    + _EVICT
    + """
local p = ARGV[1]
local retention, window, cap = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local n = 0
"""
    + _LOST
    + """
for _, id in ipairs(redis.call('ZRANGEBYSCORE', p .. ':terminal', '-inf', now - retention)) do
  n = n + evict(p, id)
end
local count = redis.call('ZCARD', p .. ':terminal')
if count > cap then
  local oldest = redis.call('ZRANGE', p .. ':terminal', 0, count - cap - 1, 'WITHSCORES')
  for i = 1, #oldest, 2 do
    -- Rows younger than the reconnect window are protected; younger ones follow them.
    if now - tonumber(oldest[i + 1]) < window then break end
    n = n + evict(p, oldest[i])
  end
end
return n
"""
)

_PURGE = (
    _EVICT
    + """
local p, run = ARGV[1], ARGV[2]
local n = 0
for _, id in ipairs(redis.call('ZRANGE', p .. ':run:' .. run, 0, -1)) do
  local state = redis.call('HGET', p .. ':job:' .. id, 'state')
  if state == 'completed' or state == 'failed' or state == 'killed' then
    n = n + evict(p, id)
  end
end
return n
"""
)


def _dt(value: bytes | str | None) -> datetime:
    return datetime.fromtimestamp(float(value or 0), UTC)


def _text(row: Mapping[bytes, bytes], name: str) -> str | None:
    value = row.get(name.encode())
    return value.decode() if value is not None else None


def row_to_snapshot(job_id: str, row: Mapping[bytes, bytes]) -> JobSnapshot:
    """Decode a ``P:job:{id}`` hash into a ``JobSnapshot``."""
    exit_code = _text(row, "exit_code")
    error = _text(row, "error")
    output_bytes = int(_text(row, "output_bytes") or 0)
    return JobSnapshot(
        job_id=job_id,
        owner_run_id=_text(row, "owner_run_id") or "",
        kind=_text(row, "kind") or "",
        state=JobState(_text(row, "state")),
        pause_behavior=JobPauseBehavior(_text(row, "pause_behavior")),
        execution_affinity=JobExecutionAffinity(_text(row, "execution_affinity")),
        output_cursor=JobCursor(job_id=job_id, offset=output_bytes),
        external_handle_ref=_text(row, "task_id") or None,
        created_at=_dt(_text(row, "created_at")),
        updated_at=_dt(_text(row, "updated_at")),
        exit_code=int(exit_code) if exit_code not in (None, "") else None,
        output_artifacts=tuple(json.loads(_text(row, "artifacts") or "[]")),
        usage=json.loads(_text(row, "usage") or "{}"),
        error=json.loads(error) if error else None,
        output_truncated=_text(row, "output_truncated") == "1",
        output_bytes=output_bytes,
        output_chunks=int(_text(row, "output_chunks") or 0),
        idempotency_key=_text(row, "idempotency_key") or None,
        labels=json.loads(_text(row, "labels") or "{}"),
    )


class RedisJobStore:
    """Atomic job-row operations over one async Redis client and key prefix."""

    def __init__(self, client: Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self._submit = client.register_script(_SUBMIT)
        self._emit = client.register_script(_EMIT)
        self._start = client.register_script(_START)
        self._finish = client.register_script(_FINISH)
        self._cancel = client.register_script(_CANCEL)
        self._orphan = client.register_script(_ORPHAN)
        self._adopt = client.register_script(_ADOPT)
        self._sweep = client.register_script(_SWEEP)
        self._beat = client.register_script(_BEAT)
        self._purge = client.register_script(_PURGE)

    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    async def submit(
        self, job_id: str, spec: JobSpec, limits: JobLimits, task_id: str
    ) -> tuple[str, str]:
        """Admit atomically: ``('created'|'existing', job_id)``, ``('full'|'capacity', n)``."""
        max_bytes, max_chunks = limits.job_caps(spec)
        fields: dict[str, Any] = {
            "job_id": job_id,
            "owner_run_id": spec.owner_run_id,
            "kind": spec.kind,
            "spec": json.dumps(spec.to_dict()),
            "pause_behavior": str(spec.pause_behavior),
            "execution_affinity": str(spec.execution_affinity),
            "idempotency_key": spec.idempotency_key or "",
            "max_bytes": max_bytes,
            "max_chunks": max_chunks,
            "agg_max_bytes": limits.max_buffered_output_bytes,
            "agg_max_chunks": limits.max_buffered_output_chunks,
            "max_concurrent": limits.max_concurrent_jobs,
            "task_id": task_id,
            # Its own field: snapshots need the labels without decoding the whole spec.
            "labels": json.dumps(dict(spec.labels)),
        }
        flat: list[Any] = []
        for name, value in fields.items():
            flat.extend((name, value))
        result = await self._submit(
            args=[
                self.prefix,
                job_id,
                spec.owner_run_id,
                spec.idempotency_key or "",
                limits.max_admitted_jobs,
                limits.max_retained_terminal_jobs + limits.max_admitted_jobs,
                *flat,
            ]
        )
        return result[0].decode(), result[1].decode()

    async def emit(self, job_id: str, stream: str, data: bytes) -> int:
        """Append output within the caps; returns bytes accepted (-1 if the job ended)."""
        return int(await self._emit(args=[self.prefix, job_id, stream, data]))

    async def start(self, job_id: str, *, worker: str = "", lost_seconds: float = 30) -> str:
        """created → running when a slot is free: ``started``, ``busy`` or ``gone``.
        ``worker`` (its name) must then `beat` within ``lost_seconds``, and again and
        again, or the job is failed as lost."""
        args = [self.prefix, job_id, worker, lost_seconds]
        return (await self._start(args=args)).decode()

    async def beat(self, job_id: str, lost_seconds: float) -> bool:
        """The running job's worker is alive: its next report is due within
        ``lost_seconds``. False when the job ended meanwhile (the worker stops it)."""
        return bool(await self._beat(args=[self.prefix, job_id, lost_seconds]))

    async def finish(
        self,
        job_id: str,
        state: JobState,
        *,
        exit_code: int | None = None,
        usage: Mapping[str, Any] | None = None,
        artifacts: tuple[str, ...] = (),
        error: Mapping[str, Any] | None = None,
    ) -> bool:
        """Move to a terminal state once; returns False if it was already terminal."""
        args: list[Any] = [self.prefix, job_id, str(state)]
        args += ["exit_code", "" if exit_code is None else exit_code]
        args += ["usage", json.dumps(dict(usage or {})), "artifacts", json.dumps(list(artifacts))]
        args += ["error", json.dumps(dict(error)) if error is not None else ""]
        return bool(await self._finish(args=args))

    async def cancel(self, job_id: str, error: Mapping[str, Any]) -> str:
        return (await self._cancel(args=[self.prefix, job_id, json.dumps(dict(error))])).decode()

    async def orphan(self, job_id: str) -> str:
        return (await self._orphan(args=[self.prefix, job_id])).decode()

    async def adopt(self, job_id: str, owner_run_id: str) -> str:
        return (await self._adopt(args=[self.prefix, job_id, owner_run_id])).decode()

    async def sweep(self, limits: JobLimits) -> int:
        """Fail the lost jobs (their worker missed its report) and evict terminal rows past
        retention or the cap; returns how many rows changed."""
        return int(
            await self._sweep(
                args=[
                    self.prefix,
                    limits.retention_seconds,
                    limits.output_reconnect_window_seconds,
                    limits.max_retained_terminal_jobs,
                    json.dumps(worker_lost_error()),
                ]
            )
        )

    async def purge(self, owner_run_id: str) -> int:
        return int(await self._purge(args=[self.prefix, owner_run_id]))

    async def row(self, job_id: str) -> dict[bytes, bytes] | None:
        row = await self.client.hgetall(self.key("job", job_id))
        return row or None

    async def tombstone(self, job_id: str) -> dict[bytes, bytes] | None:
        row = await self.client.hgetall(self.key("tomb", job_id))
        return row or None

    async def states(self, job_ids: list[str]) -> list[str | None]:
        """Current states of many jobs in one round trip (None when the row is gone)."""
        async with self.client.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hget(self.key("job", job_id), "state")
            values = await pipe.execute()
        return [v.decode() if v is not None else None for v in values]

    async def cancel_requested(self, job_id: str) -> bool:
        return await self.client.hget(self.key("job", job_id), "cancel") == b"1"

    async def run_job_ids(self, owner_run_id: str) -> list[str]:
        ids = await self.client.zrange(self.key("run", owner_run_id), 0, -1)
        return [i.decode() for i in ids]

    async def read_output(self, cursor: JobCursor, max_bytes: int) -> tuple[JobOutputChunk, ...]:
        """Exact slices from ``cursor.offset`` (see ``InMemoryJobRuntime.read_output``)."""
        job_id, offset = cursor.job_id, cursor.offset
        found = await self.client.zrevrangebyscore(
            self.key("outidx", job_id), offset, "-inf", start=0, num=1
        )
        index = int(found[0]) if found else 0
        out: list[JobOutputChunk] = []
        remaining = max_bytes
        # Fetch in pages: most reads are satisfied by the first few chunks.
        page = 64
        while remaining > 0:
            entries = await self.client.lrange(self.key("out", job_id), index, index + page - 1)
            if not entries:
                break
            index += len(entries)
            for entry in entries:
                stream, chunk_offset, occurred, data = entry.split(b"\n", 3)
                base = int(chunk_offset)
                start = max(offset - base, 0)
                if start >= len(data):
                    continue
                piece = data[start : start + remaining]
                out.append(
                    JobOutputChunk(
                        job_id=job_id,
                        stream=JobStream(stream.decode()),
                        offset=base + start,
                        next_offset=base + start + len(piece),
                        data=piece,
                        occurred_at=_dt(occurred.decode()),
                    )
                )
                remaining -= len(piece)
                offset = base + start + len(piece)
                if remaining <= 0:
                    break
        return tuple(out)

    async def counters(self) -> dict[str, int]:
        names = ("admitted", "running", "rows", "agg:bytes", "agg:chunks")
        values = await self.client.mget([self.key(n) for n in names])
        return {n.replace(":", "_"): int(v or 0) for n, v in zip(names, values, strict=True)}

    async def terminal_count(self) -> int:
        return int(await self.client.zcard(self.key("terminal")))


def is_terminal(state: str | None) -> bool:
    return state is not None and JobState(state) in TERMINAL_STATES

"""Replica processes on one node: start, watch, drain, stop, and survive an agent restart.

Owns the engine child processes of this agent. Each replica runs in its own process
group on a port allocated here, with CUDA_VISIBLE_DEVICES set to its GPUs. A watcher
per replica reports Starting -> Ready (health endpoint answers 200) and Failed (the
process exited, or never became healthy). What runs is written to a state file, so a
restarted agent adopts its still-running engines instead of restarting them.
Everything here runs on the agent's event loop; status changes go to one callback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from agents.launchers import Command, Launch, build
from agents.pb.llmgw.agent.v1 import ReplicaSpec, ReplicaState, ReplicaStatus
from controlplane.netutil import free_port

log = logging.getLogger("llmgw.agent.replicas")


@dataclass
class Replica:
    replica_id: str
    model: str
    engine: str
    host: str  # advertised to the control plane (and so to Envoy)
    bind: str  # where the engine listens
    port: int
    gpu_indices: list[int]
    profile_hash: str
    health_path: str
    in_flight_metrics: list[str]
    pid: int = 0
    state: int = ReplicaState.STARTING
    message: str = ""
    in_flight: int = 0
    stop_requested: bool = field(default=False, repr=False)

    def status(self) -> ReplicaStatus:
        return ReplicaStatus(
            replica_id=self.replica_id, model=self.model, state=ReplicaState(self.state),
            host=self.host, port=self.port, in_flight=self.in_flight,
            gpu_indices=list(self.gpu_indices), profile_hash=self.profile_hash,
            message=self.message, pid=self.pid,
        )

    def url(self, path: str) -> str:
        host = "127.0.0.1" if self.bind in ("0.0.0.0", "") else self.bind
        return f"http://{host}:{self.port}{path}"


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return True


class ReplicaManager:
    def __init__(
        self,
        state_dir: Path,
        *,
        advertise: str = "127.0.0.1",
        bind: str = "127.0.0.1",
        on_change: Callable[[ReplicaStatus], None] = lambda s: None,
        startup_timeout: float = 900.0,
        stop_timeout: float = 10.0,
        drain_grace_s: float = 1.0,
    ) -> None:
        self.state_dir = state_dir
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._state_file = state_dir / "replicas.json"
        self.advertise = advertise
        self.bind = bind
        self.on_change = on_change
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.drain_grace_s = drain_grace_s
        self._replicas: dict[str, Replica] = {}
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------------ queries

    def statuses(self) -> list[ReplicaStatus]:
        return [r.status() for r in sorted(self._replicas.values(), key=lambda r: r.replica_id)]

    def running(self) -> bool:
        return any(r.state in (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.DRAINING)
                   for r in self._replicas.values())

    def get(self, replica_id: str) -> Replica | None:
        return self._replicas.get(replica_id)

    # ------------------------------------------------------------------ state file

    def _save(self) -> None:
        live = [asdict(r) for r in self._replicas.values()
                if r.state not in (ReplicaState.STOPPED, ReplicaState.FAILED)]
        tmp = self._state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(live, indent=1))
        os.replace(tmp, self._state_file)

    async def adopt(self) -> list[str]:
        """Take over engines a previous agent process left running; return their ids."""
        try:
            entries = json.loads(self._state_file.read_text())
        except FileNotFoundError:
            return []
        except (OSError, json.JSONDecodeError) as e:
            log.warning("ignoring unreadable state file %s: %s", self._state_file, e)
            return []
        adopted = []
        for entry in entries:
            entry.pop("stop_requested", None)
            r = Replica(**entry)
            if not _alive(r.pid):
                log.info("replica %s (pid %d) from the last run is gone", r.replica_id, r.pid)
                continue
            r.state = ReplicaState.STARTING
            self._replicas[r.replica_id] = r
            if await self._healthy(r):
                r.state = ReplicaState.READY
            adopted.append(r.replica_id)
            log.info("adopted running replica %s (%s, pid %d, port %d)", r.replica_id, r.model,
                     r.pid, r.port)
            self._tasks[r.replica_id] = asyncio.create_task(self._watch(r))
        self._save()
        return adopted

    # ------------------------------------------------------------------ commands

    async def start(self, spec: ReplicaSpec) -> None:
        if spec.replica_id in self._replicas:
            r = self._replicas[spec.replica_id]
            if r.state in (ReplicaState.STARTING, ReplicaState.READY):
                self._emit(r)  # idempotent: just say how it is
                return
        port = free_port(self.bind if self.bind not in ("0.0.0.0", "") else "127.0.0.1")
        launch = Launch(
            replica_id=spec.replica_id, model=spec.model, engine=spec.engine or "sim",
            model_path=spec.model_path, host=self.bind, port=port,
            gpu_indices=tuple(spec.gpu_indices), args=tuple(spec.args), env=dict(spec.env),
        )
        r = Replica(
            replica_id=spec.replica_id, model=spec.model, engine=launch.engine,
            host=self.advertise, bind=self.bind, port=port,
            gpu_indices=list(spec.gpu_indices), profile_hash=spec.profile_hash,
            health_path="/health", in_flight_metrics=[],
        )
        self._replicas[r.replica_id] = r
        try:
            cmd: Command = build(launch)
        except ValueError as e:
            self._set(r, ReplicaState.FAILED, str(e))
            return
        r.health_path = cmd.health_path
        r.in_flight_metrics = list(cmd.in_flight_metrics)
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd.argv, env={**os.environ, **cmd.env}, start_new_session=True,
                stdin=asyncio.subprocess.DEVNULL,
            )
        except OSError as e:
            self._set(r, ReplicaState.FAILED, f"cannot launch {cmd.argv[0]}: {e}")
            return
        r.pid = proc.pid
        self._procs[r.replica_id] = proc
        log.info("started replica %s (%s) on port %d, GPUs %s, pid %d: %s", r.replica_id,
                 r.model, port, r.gpu_indices or "none", proc.pid, " ".join(cmd.argv))
        self._save()
        self._emit(r)
        self._tasks[r.replica_id] = asyncio.create_task(self._watch(r))

    async def drain(self, replica_id: str, timeout_s: float) -> None:
        r = self._replicas.get(replica_id)
        if r is None or r.state in (ReplicaState.STOPPED, ReplicaState.FAILED):
            return
        self._set(r, ReplicaState.DRAINING, f"draining (up to {timeout_s:.0f}s)")
        deadline = time.monotonic() + max(0.0, timeout_s)
        # Give the data plane time to see DRAINING before "no requests" can be
        # trusted: a request may still be on its way from Envoy.
        await asyncio.sleep(min(self.drain_grace_s, max(0.0, timeout_s)))
        while time.monotonic() < deadline:
            n = await self._in_flight(r)
            if n is not None and n != r.in_flight:
                r.in_flight = n
                self._emit(r)
            if n == 0:
                break
            await asyncio.sleep(0.2)
        else:
            log.warning("replica %s still had %d requests in flight at its drain timeout",
                        replica_id, r.in_flight)
        await self.stop(replica_id, "drained")

    async def stop(self, replica_id: str, why: str = "stopped by the control plane") -> None:
        r = self._replicas.get(replica_id)
        if r is None:
            return
        r.stop_requested = True
        await self._terminate(r)
        task = self._tasks.pop(replica_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._procs.pop(replica_id, None)
        self._set(r, ReplicaState.STOPPED, why)
        del self._replicas[replica_id]
        self._save()

    async def stop_all(self, why: str) -> None:
        await asyncio.gather(*(self.stop(rid, why) for rid in list(self._replicas)))

    async def close(self) -> None:
        """Stop watching (not the engines): for an agent that exits leaving them running."""
        for t in self._tasks.values():
            t.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ internals

    def _set(self, r: Replica, state: int, message: str = "") -> None:
        if r.state == state and r.message == message:
            return
        r.state = state
        r.message = message
        if state in (ReplicaState.STOPPED, ReplicaState.FAILED):
            r.in_flight = 0
        self._save()
        self._emit(r)

    def _emit(self, r: Replica) -> None:
        self.on_change(r.status())

    async def _sess(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        return self._session

    async def _healthy(self, r: Replica) -> bool:
        try:
            s = await self._sess()
            async with s.get(r.url(r.health_path)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    async def _in_flight(self, r: Replica) -> int | None:
        if not r.in_flight_metrics:
            return 0
        try:
            s = await self._sess()
            async with s.get(r.url("/metrics")) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None
        total = 0.0
        wanted = set(r.in_flight_metrics)
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                if sample.name in wanted:
                    total += sample.value
        return int(total)

    async def _exited(self, r: Replica) -> int | None:
        """Wait until the engine process is gone; its exit code when it is our child."""
        proc = self._procs.get(r.replica_id)
        if proc is not None:
            return await proc.wait()
        # Not our child (adopted after an agent restart): poll, there is no wait().
        while _alive(r.pid):  # noqa: ASYNC110
            await asyncio.sleep(0.5)
        return None

    async def _watch(self, r: Replica) -> None:
        exit_wait = asyncio.create_task(self._exited(r))
        try:
            deadline = time.monotonic() + self.startup_timeout
            while r.state == ReplicaState.STARTING:
                if exit_wait.done():
                    code = exit_wait.result()
                    self._set(r, ReplicaState.FAILED,
                              f"engine exited (code {code}) before it became healthy")
                    return
                if await self._healthy(r):
                    self._set(r, ReplicaState.READY)
                    log.info("replica %s (%s) is ready on port %d", r.replica_id, r.model,
                             r.port)
                    break
                if time.monotonic() > deadline:
                    self._set(r, ReplicaState.FAILED,
                              f"not healthy after {self.startup_timeout:.0f}s")
                    await self._terminate(r)
                    return
                await asyncio.wait({exit_wait}, timeout=0.2)
            code = await exit_wait
            if not r.stop_requested:
                log.warning("replica %s (%s) exited unexpectedly (code %s)", r.replica_id,
                            r.model, code)
                self._set(r, ReplicaState.FAILED, f"engine exited unexpectedly (code {code})")
        finally:
            exit_wait.cancel()

    async def _terminate(self, r: Replica) -> None:
        if not _alive(r.pid):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(r.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        while _alive(r.pid) and time.monotonic() < deadline:
            proc = self._procs.get(r.replica_id)
            if proc is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 0.1)
            else:
                await asyncio.sleep(0.1)
        if _alive(r.pid):
            log.warning("replica %s did not stop in %.0fs: SIGKILL", r.replica_id,
                        self.stop_timeout)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(r.pid, signal.SIGKILL)
            proc = self._procs.get(r.replica_id)
            if proc is not None:
                await proc.wait()

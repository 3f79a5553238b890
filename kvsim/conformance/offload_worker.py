"""The worker side of vLLM 0.33.0's `OffloadingConnector` without a GPU: its transfer jobs on the replay's clock.

vLLM's scheduler side (`OffloadingConnectorScheduler`, run unmodified beside kvsim's replay) hands each step's
jobs to the workers in `OffloadingConnectorMetadata`; the workers (`offloading/worker.py`,
`v1/kv_offload/cpu/gpu_worker.py`) move the blocks and report each finished job in the step's output
(`OffloadingWorkerMetadata.completed_jobs`, and `finished_recving` for a finished load). This stand-in keeps
their order and times each job as kvsim's replay does (`kvsim.replay.sched.offloading_connector`):

1. `handle_preemptions`: the jobs to flush that this step created are submitted first; the step then waits until
   every job to flush has finished.
2. `start_kv_transfers`: the step's loads start (each after the loads submitted before it: one queue a direction);
   a synchronous load (`sync_load_budget_bytes`) on its own queue (the expedited handler), and the step waits for it.
3. The forward pass runs for the step's time.
4. `prepare_store_kv`: the step's stores are submitted when it ends (vLLM defers them to the next step's start; a
   step follows the one before it at once, and an idle engine with jobs in flight keeps stepping).
5. `get_finished`: the jobs finished by the step's end are reported, in job order.

A job takes `GPU blocks x bytes_per_block / host bandwidth` seconds: one rank's bytes over its host link.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class WorkerJob:
    job_id: int
    req_id: str
    is_store: bool
    num_bytes: int
    finish_s: float | None = None
    queue: str = ""  # "load", "store" or "sync"
    sync: bool = False


class SimulatedOffloadWorker:
    """Times the jobs of each step's `OffloadingConnectorMetadata` and reports them finished as vLLM's workers do."""

    def __init__(self, bytes_per_block: int, host_bandwidth_bytes_per_s: float) -> None:
        self.bytes_per_block = bytes_per_block
        self.host_bandwidth = host_bandwidth_bytes_per_s
        self._jobs: dict[int, WorkerJob] = {}
        self._free_at = {"load": 0.0, "store": 0.0, "sync": 0.0}  # per queue: when it drains

    def _submit(self, job: WorkerJob, ready_s: float) -> None:
        queue = "store" if job.is_store else ("sync" if job.sync else "load")
        start = max(ready_s, self._free_at[queue])
        job.finish_s = start + job.num_bytes / self.host_bandwidth
        self._free_at[queue] = job.finish_s

    def _job(self, job_id: int, entry, is_store: bool) -> WorkerJob:
        gpu = entry.src_spec if is_store else entry.dst_spec
        job = WorkerJob(job_id, entry.req_id, is_store, len(gpu.block_ids) * self.bytes_per_block,
                        sync=not is_store and bool(entry.sync))
        self._jobs[job_id] = job
        return job

    def execute(self, meta, start_s: float, forward_s: float) -> float:
        """One step that starts at `start_s` and computes for `forward_s`: returns how long it waits first for
        flushed jobs. `meta` is the step's OffloadingConnectorMetadata (None: no connector work)."""
        if meta is None:
            return 0.0
        flush = meta.jobs_to_flush or set()
        stores = dict(meta.store_jobs)
        for job_id in sorted(flush):  # handle_preemptions: this step's jobs to flush go first
            entry = stores.pop(job_id, None)
            if entry is not None:
                self._submit(self._job(job_id, entry, True), start_s)
        finish = [self._jobs[j].finish_s for j in flush if j in self._jobs]
        wait = max([0.0] + [f - start_s for f in finish])
        sync_finish = []
        for job_id, entry in meta.load_jobs.items():  # start_kv_transfers
            job = self._job(job_id, entry, False)
            self._submit(job, start_s + wait)
            if job.sync:
                sync_finish.append(job.finish_s)
        wait = max([wait] + [f - start_s for f in sync_finish])  # the step waits for its synchronous loads
        for job_id, entry in stores.items():  # prepare_store_kv: at the step's end
            self._submit(self._job(job_id, entry, True), start_s + wait + forward_s)
        return wait

    def has_jobs(self) -> bool:
        return bool(self._jobs)

    def next_finish_s(self) -> float | None:
        times = [j.finish_s for j in self._jobs.values()]
        return min(times) if times else None

    def finished_by(self, t: float) -> tuple[dict[int, int], set[str]]:
        """`get_finished` at `t`: the jobs finished by then ({job id: 1}, one worker) and the requests whose load
        finished (`finished_recving`); they are forgotten."""
        done = sorted(j for j, job in self._jobs.items() if job.finish_s <= t)
        recving = {self._jobs[j].req_id for j in done if not self._jobs[j].is_store and not self._jobs[j].sync}
        for j in done:
            del self._jobs[j]
        return {j: 1 for j in done}, recving

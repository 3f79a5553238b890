"""The scheduler as vLLM v1 0.33.0's `v1/core/sched/`: `Scheduler` (`scheduler.py`) and what it schedules and
hands on (`output.py`: `SchedSeq`, `SchedulerOutput`). May import `engine`."""

"""The replay: the scheduler (vLLM v1's rules) and what one step schedules (`sched/`), one allocator's step loop, its
options, records and worker processes, the tensor runner, the report files and the summary table. It may
import every earlier stage (`models`, `clock`, `size`, `engine`, `workload`), nothing later.
"""

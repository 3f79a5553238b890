"""A deployment: N replicas of the replay's engine behind a router, on one simulated clock (`fleet.py`, with the
routing policies in `router.py` and the block hashes they read in `prefix_hashes.py`), its reports
(`reports.py`, `charts.py`), the per-replica request streams (`streams.py`) and `kvsim plan`'s search for
the fewest GPUs (`plan.py`, searched by `plan_search.py`, a replay cut short by `slo_watch.py`). May import
every stage up to `replay` and `plots`, and `cache_curve`, `sweep`."""

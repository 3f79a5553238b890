"""`kvsim sweep`: grids of replays over workload fields, run locally or on Ray, into one resumable table.

Stages, each a module: `spec` (the sweep file), `points` (expansion and validation), `task` (one replay per
point and allocator, or one capacity search: `search`), `runners` (local processes, Ray), `results` (the
table and its journal), `view` (the command's progress bar). Beside the stages: it may import kvsim's workload
and replay modules only, and nothing imports it but the CLI.
"""

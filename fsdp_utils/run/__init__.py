"""Around a run: what is checked and prepared before training starts.

`preflight` checks a run in seconds before it costs GPU time (`chess_finetune.py
--preflight`, run by the sbatch script); `start` prepares the run folder (a fresh start sets
the previous run aside) and checks its storage; `shared_paths` makes sure every node sees the
run folder and the caches; `host_memory` makes freed host memory go back to the system.
"""

"""The rendezvous store of a multi-node job, hosted by the batch script instead of a torchrun.

    python -m fsdp_utils.slurm.rdzv_store PORT &     # slurm/finetune.sh, on the first node
    torchrun --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --rdzv-conf=is_host=false ...

With torchrun's c10d rendezvous one agent (the one on the endpoint's node) hosts the store in
its own process, so the store ends when that torchrun exits. Agents on the other nodes still
close the rendezvous through it at the very end, and the last ones print "The node ... has
failed to shutdown the rendezvous ... due to an error of type RendezvousConnectionError" once it
is gone: a harmless race that users read as a failure. Here the store lives in the batch
script's own process, which outlives every torchrun of the job step, and all agents are clients.

It serves until SIGTERM or SIGINT and then exits 0 without a word.
"""

from __future__ import annotations

import datetime
import signal
import sys

from fsdp_utils.arguments import ArgumentParser


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m fsdp_utils.slurm.rdzv_store")
    parser.add_argument("port", type=int)
    args = parser.parse_args(argv)
    from torch.distributed import TCPStore

    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)  # delivered to sigwait below
    try:
        # multi_tenant: torchrun's agents open their clients with multi_tenant=True as well.
        store = TCPStore(
            "0.0.0.0",
            args.port,
            is_master=True,
            wait_for_workers=False,
            multi_tenant=True,
            timeout=datetime.timedelta(seconds=60),
        )
    except (RuntimeError, ValueError) as error:
        print(
            f"error: cannot serve the rendezvous store on port {args.port}: {error}",
            file=sys.stderr,
        )
        return 1
    signal.sigwait(stop_signals)
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())

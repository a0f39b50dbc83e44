from fsdp_utils.hub.offline import enable_offline_mode

# Compute nodes have no internet: the Hugging Face libraries read these at import time.
enable_offline_mode()

from fsdp_utils.chess_eval.cli import main  # noqa: E402

raise SystemExit(main())

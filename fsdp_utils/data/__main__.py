from fsdp_utils.hub.offline import enable_offline_mode

# Compute nodes have no internet: the Hugging Face libraries read these at import time.
enable_offline_mode()

from fsdp_utils.data.cli import main  # noqa: E402 - after the offline switch

raise SystemExit(main())

from fsdp_utils.data.cli import main

raise SystemExit(main())

from fsdp_utils.plan.cli import main

raise SystemExit(main())

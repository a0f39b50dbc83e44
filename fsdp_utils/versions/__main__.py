from fsdp_utils.versions import main

raise SystemExit(main())

from syncd.cli import main

raise SystemExit(main())

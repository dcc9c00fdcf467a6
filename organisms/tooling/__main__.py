from organisms.tooling.cli import main

raise SystemExit(main())

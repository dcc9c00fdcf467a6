from kvprobe.runner.cli import main

raise SystemExit(main())

from kvprobe.app.cli import main

raise SystemExit(main())

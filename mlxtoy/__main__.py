from mlxtoy.cli import main

raise SystemExit(main())

from .plugin import main

raise SystemExit(main())
